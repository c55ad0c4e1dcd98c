"""Stage 7, runtime: turning a Plan into a module that trains on local per-rank tensors."""

from autoparallel.runtime.memory import MeasuredMemory, measure_memory
from autoparallel.runtime.module import InputMismatchError, apply_placement
from autoparallel.runtime.timing import StepTiming, measure_step

__all__ = [
    "InputMismatchError",
    "MeasuredMemory",
    "StepTiming",
    "apply_placement",
    "measure_memory",
    "measure_step",
]
