"""Helpers for the project's tests and benchmarks: not part of the public API.

``harness`` runs a function on N gloo ranks and the single-device reference training loop.
"""
