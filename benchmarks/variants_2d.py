"""The variants of ``step_time --mesh DPxTP`` that are not ours as planned: the hand recipe,
and ours planned within torch's styles, run by our runtime and as exported torch code.

``ours-styles`` is the plan of ``autoparallel plan --torch-styles`` (export/restrict.py) run
by the parallel module; ``exported`` is the same plan written by ``autoparallel export`` and
run by torch alone (``fully_shard``, ``parallelize_module``). Their step times side by side
say what our runtime adds or saves on the same placements; ``hand-2d`` (benchmarks/recipes.py)
is what an engineer writes without a planner.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.export import plan_in_torch_styles, to_torch_code
from benchmarks.recipes import parallelize_llama_2d
from benchmarks.workloads import WORKLOADS, check_same_plan

HAND_2D = "hand-2d"
"""The 2-D recipe written by hand (benchmarks/recipes.py): TP + SP on tp, FSDP2 on dp."""

OURS_STYLES = "ours-styles"
EXPORTED = "exported"
VARIANTS = (HAND_2D, OURS_STYLES, EXPORTED)


def initialized(workload: Any) -> nn.Module:
    model = workload.build()
    model.init_weights(seed=0)
    return model


def build_2d_variant(
    variant: str, model_name: str, mesh: Any, hardware: str | None
) -> tuple[nn.Module, dict]:
    """``variant`` (one of :data:`VARIANTS`) of ``model_name`` on the (dp, tp) ``mesh``,
    materialized from seed 0; with what the planned variants record."""
    workload = WORKLOADS[model_name]
    if variant == HAND_2D:
        return parallelize_llama_2d(initialized(workload), mesh), {}
    start = time.perf_counter()
    autop, plan, free_ms = _plan_in_styles(workload, mesh, hardware)
    extra = {
        "planning_s": round(time.perf_counter() - start, 3),
        "predicted_ms": round(plan.totals.total_us / 1e3, 3),
        "free_predicted_ms": round(free_ms, 3),
        "priced_on": plan.priced_on,
    }
    if variant == OURS_STYLES:
        parallel = autop.apply_placement(plan)
        parallel.to_empty(device="cpu")
        parallel.init_weights(seed=0)
        return parallel, extra
    code = to_torch_code(plan)
    if code.unexpressed:
        raise RuntimeError(f"the restricted plan left {len(code.unexpressed)} choices unexpressed")
    namespace: dict[str, Any] = {}
    exec(compile(code.source, "parallelize_model.py", "exec"), namespace)
    return namespace["parallelize"](initialized(workload), mesh), extra


def _plan_in_styles(workload: Any, mesh: Any, hardware: str | None):
    """Ours planned as ``autoparallel plan --torch-styles`` does: (AutoParallel, plan, the
    free plan's predicted ms under the same constraints)."""
    with torch.device("meta"):
        model = workload.build()
    inputs, _ = workload.global_batch()
    rows = (Shard(0), Replicate())
    with AutoParallel(model, lambda: inputs, mesh, hardware=hardware) as autop:
        autop.add_input_constraints([rows])
        autop.add_output_constraints([rows])
        free = autop.optimize_placement()
        restricted = plan_in_torch_styles(autop.sharding_optimizer, free, 0, 1)
        check_same_plan(restricted.plan)
    return autop, restricted.plan, restricted.free_step_us / 1e3


def first_losses_agree(results: dict[str, dict]) -> bool:
    """Same init, same batch: every variant's first loss is the one-device loss."""
    firsts = [r["loss_first"] for r in results.values() if r["status"] == "ok"]
    return bool(firsts) and max(firsts) - min(firsts) <= 1e-4 * max(abs(f) for f in firsts)
