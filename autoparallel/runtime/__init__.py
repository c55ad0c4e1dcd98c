"""Stage 7, runtime: turning a Plan into a module that trains on local per-rank tensors."""

from autoparallel.runtime.faults import RankLostError, translate_rank_loss
from autoparallel.runtime.memory import MeasuredMemory, measure_memory
from autoparallel.runtime.module import InputMismatchError, apply_placement
from autoparallel.runtime.timing import StepTiming, measure_step

__all__ = [
    "InputMismatchError",
    "MeasuredMemory",
    "RankLostError",
    "StepTiming",
    "apply_placement",
    "measure_memory",
    "measure_step",
    "translate_rank_loss",
]
