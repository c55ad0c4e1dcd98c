"""Helpers for the project's tests and benchmarks: not public, and no library module imports
them. ``harness`` holds the single-device reference training loop and full-value gathers."""
