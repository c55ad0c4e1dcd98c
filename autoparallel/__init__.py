"""autoparallel: plan and apply the parallelization of a PyTorch model automatically."""

from autoparallel.api import AutoParallel, auto_parallel
from autoparallel.cost.hardware import HARDWARE_PRESETS, Hardware
from autoparallel.cost.topology import Topology
from autoparallel.mesh_search import MeshCandidate, MeshSearch, MeshSearchError, search_mesh
from autoparallel.regions import LocalMapError, collectives, current_mesh, local_map
from autoparallel.runtime import (
    InputMismatchError,
    MeasuredMemory,
    RankLostError,
    StepTiming,
    measure_memory,
    measure_step,
    translate_rank_loss,
)
from autoparallel.runtime.compile import autoparallel_backend
from autoparallel.runtime.dynamic import DynamicShapeError
from autoparallel.runtime.gloo import UnsafeProcessGroupError, serial_gloo_backend
from autoparallel.runtime.init import InitError, full_value_init
from autoparallel.runtime.launch import fake_mesh
from autoparallel.runtime.pipeline import ParallelPipeline
from autoparallel.runtime.shutdown import shutdown_distributed
from autoparallel.solver.highs import InfeasibleConstraintsError
from autoparallel.trace.errors import TraceError
from autoparallel.trace.sharding_constraint import with_sharding_constraint
from autoparallel.types.memory import MemoryEstimate
from autoparallel.types.pipeline import PipelineConfig, PipelineError, PipelinePlan
from autoparallel.types.plan import Plan

__all__ = [
    "AutoParallel",
    "auto_parallel",
    "fake_mesh",
    "search_mesh",
    "MeshSearch",
    "MeshCandidate",
    "MeshSearchError",
    "shutdown_distributed",
    "serial_gloo_backend",
    "UnsafeProcessGroupError",
    "autoparallel_backend",
    "with_sharding_constraint",
    "local_map",
    "LocalMapError",
    "current_mesh",
    "collectives",
    "InputMismatchError",
    "RankLostError",
    "translate_rank_loss",
    "measure_step",
    "StepTiming",
    "measure_memory",
    "MeasuredMemory",
    "DynamicShapeError",
    "InitError",
    "full_value_init",
    "Plan",
    "MemoryEstimate",
    "ParallelPipeline",
    "PipelineConfig",
    "PipelinePlan",
    "PipelineError",
    "InfeasibleConstraintsError",
    "TraceError",
    "Hardware",
    "Topology",
    "HARDWARE_PRESETS",
]
