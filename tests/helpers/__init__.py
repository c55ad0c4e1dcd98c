"""Shared helpers of the test modules: planning shortcuts and the multi-rank cases."""
