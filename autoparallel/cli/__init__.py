"""The ``autoparallel`` command: ``plan`` (plan.py; the parser and its checks in
plan_arguments.py), ``explain`` and ``diff`` (saved.py), ``calibrate`` (calibrate.py)."""

from autoparallel.cli.plan import main

__all__ = ["main"]
