"""autoparallel: plan and apply the parallelization of a PyTorch model automatically."""

from autoparallel.api import AutoParallel
from autoparallel.solver.highs import InfeasibleConstraintsError
from autoparallel.solver.plan import Plan
from autoparallel.topology import HARDWARE_PRESETS, Hardware, Topology

__all__ = ["AutoParallel", "Plan", "InfeasibleConstraintsError", "Hardware", "Topology", "HARDWARE_PRESETS"]
