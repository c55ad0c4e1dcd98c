"""Stage 6: turning a Plan into a module that trains on local per-rank tensors."""

from autoparallel.runtime.module import InputMismatchError, apply_placement

__all__ = ["InputMismatchError", "apply_placement"]
