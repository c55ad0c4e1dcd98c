"""Stage 6: turning a Plan into a module that trains on local per-rank tensors."""

from autoparallel.runtime.module import InputMismatchError, apply_placement
from autoparallel.runtime.timing import StepTiming, measure_step

__all__ = ["InputMismatchError", "StepTiming", "apply_placement", "measure_step"]
