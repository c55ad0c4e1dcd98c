"""The ``autoparallel`` command: ``plan`` (plan.py), ``explain`` and ``diff`` (saved.py)."""

from autoparallel.cli.plan import main

__all__ = ["main"]
