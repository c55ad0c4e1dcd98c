"""How much of our plans torch's own styles can write: ``autoparallel export``'s coverage.

    python -m benchmarks.export_coverage [--hardware cpu]

Plans, on fake meshes (nothing runs), the MLP and the tiny LLaMA in the settings issue 47
names: 1-D data parallel, 2-D (dp, tp), under the bf16/fp32 mixed-precision policy, with
recomputation under a memory budget. Each setting is planned free (with the parameter
memory constraint) and again within torch's styles (``plan_in_torch_styles``); the export of
each is asked what it cannot write. Prints one line per setting (choices not expressed in
the free plan and in the restricted one, and the restriction's cost) and appends one record
per setting to ``benchmarks/results/export_coverage.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel, fake_mesh
from autoparallel.export import plan_in_torch_styles, to_torch_code
from autoparallel.models import MLP, Llama, llama_config
from benchmarks.results import preset_suffix, record

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@dataclass(frozen=True)
class Setting:
    name: str
    model: str  # "mlp" | "llama"
    mesh: tuple[int, ...]
    policy: Any = None
    recompute: bool = False


SETTINGS = (
    Setting("mlp-2", "mlp", (2,)),
    Setting("mlp-2x2", "mlp", (2, 2)),
    Setting("llama-4", "llama", (4,)),
    Setting("llama-2x2", "llama", (2, 2)),
    Setting("llama-2x2-bf16", "llama", (2, 2), policy=BF16),
    Setting("llama-4-recompute", "llama", (4,), recompute=True),
)


def _model_and_inputs(setting: Setting):
    if setting.model == "mlp":
        with torch.device("meta"):
            return MLP(64, 256), lambda: torch.randn(64, 64)
    config = llama_config("tiny")
    with torch.device("meta"):
        model = Llama(config)
    return model, lambda: torch.randint(0, config.vocab_size, (8, 32))


def measure(setting: Setting, hardware: str) -> dict[str, Any]:
    """Plan ``setting`` free and within torch's styles; what each export leaves unwritten."""
    names = ("dp",) if len(setting.mesh) == 1 else ("dp", "tp")
    mesh = fake_mesh(setting.mesh, names)
    model, inputs = _model_and_inputs(setting)
    rows = (Shard(0),) + (Replicate(),) * (len(setting.mesh) - 1)
    try:
        with AutoParallel(model, inputs, mesh, setting.policy, hardware=hardware) as autop:
            autop.add_input_constraints([rows])
            autop.add_output_constraints([rows])
            autop.add_parameter_memory_constraint()
            if setting.recompute:
                free = autop.optimize_placement()
                budget = 0.8 * free.memory.peak
                autop.add_memory_constraint(budget, activation_checkpointing="auto")
            free = autop.optimize_placement()
            free_code = to_torch_code(free)
            model_dim = 1 if len(setting.mesh) > 1 else None
            restricted = plan_in_torch_styles(
                autop.sharding_optimizer,
                free,
                0,
                model_dim,
                drop_parameter_memory=model_dim is not None,
            )
            code = to_torch_code(restricted.plan, setting.policy)
    finally:
        dist.destroy_process_group()
    return {
        "setting": setting.name,
        "free_unexpressed": len(free_code.unexpressed),
        "free_unexpressed_names": [u.name for u in free_code.unexpressed][:8],
        "unexpressed": len(code.unexpressed),
        "unexpressed_names": [u.name for u in code.unexpressed],
        "cost_ratio": round(restricted.cost_ratio, 4),
        "recomputed": list(restricted.plan.recompute),
        "styles": sorted({s.style for s in code.recipe.styles}),
        "data_parallel": code.recipe.data_parallel,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", default="cpu", help="preset or profile to price on")
    args = parser.parse_args(argv)
    figures = []
    for setting in SETTINGS:
        result = measure(setting, args.hardware)
        print(
            f"{setting.name:20s} free plan: {result['free_unexpressed']:3d} not expressed; "
            f"within torch's styles: {result['unexpressed']} not expressed, "
            f"{100 * (result['cost_ratio'] - 1):+.1f} % predicted step, "
            f"{result['data_parallel']} {' '.join(result['styles'])}",
            flush=True,
        )
        figures.append(
            {
                "question": f"export-{setting.name}" + preset_suffix(args.hardware),
                "what": f"choices of the plan within torch's styles that the export cannot write, "
                f"{setting.name} (the free plan's in free_unexpressed; the restriction's cost in "
                "cost_ratio)",
                "figure": result["unexpressed"],
                "unit": "choices",
                **result,
            }
        )
    record("export_coverage", figures, argv if argv is not None else sys.argv[1:])
    return 1 if any(f["unexpressed"] for f in figures) else 0


if __name__ == "__main__":
    sys.exit(main())
