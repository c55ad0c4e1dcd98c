"""Planning time of the whole pipeline (trace -> plan) for LLaMA-3 shapes on a fake mesh.

Prints one JSON line: stage times in seconds, problem size before and after folding, the
objective and the peak RSS. Nothing is allocated for the model (meta device) and nothing
communicates (fake process group).

    python -m benchmarks.plan_time --model llama3-8b --mesh 8x8
    python -m benchmarks.plan_time --model llama3-70b --mesh 4x8x8 --layers 80
    python -m benchmarks.plan_time --model llama3-8b --mesh 4x8x8 --layers 2 --build-only
    python -m benchmarks.plan_time --model hf-llama3-8b --mesh 8x8   # transformers' LlamaForCausalLM
    python -m benchmarks.plan_time --model llama3-8b --mesh 8x8 --mixed-precision \
        --memory-budget halfway --activation-checkpointing auto
    python -m benchmarks.plan_time --model moe-16b --mesh 8x8   # mesh dims named dp, ep

The line is also appended to ``benchmarks/results/plan_time.jsonl`` (``benchmarks.results``),
its figure the total planning time, under a question key built from the arguments
(``question``); ``--build-only`` runs are not recorded.

``moe-tiny`` and ``moe-16b`` are the mixture-of-experts reference model
(``autoparallel.models.moe``); its routed experts are split over the mesh dim named ``ep``,
so a 2-D mesh is named ("dp", "ep") and a 3-D one ("dp", "ep", "tp").

``--memory-budget halfway`` first plans without a memory constraint (timed apart, as
``reference_s``) and then budgets halfway between that plan's peak and the smallest peak any
plan could reach recomputing every layer (a lower bound); with ``--activation-checkpointing
auto`` it also plans recomputing every layer under the same budget, so the line shows what
recomputing only some layers saves (``every_layer_objective_us``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import resource
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel, fake_mesh
from autoparallel.cli.common import parse_bytes
from autoparallel.models import Llama, llama_config
from autoparallel.models.moe import MoETransformer, moe_config
from benchmarks.results import record

MOE_MODELS = ("moe-tiny", "moe-16b")
MOE_MESH_NAMES = {1: ("ep",), 2: ("dp", "ep"), 3: ("dp", "ep", "tp")}


def hf_llama_like(config, seq: int):
    """Hugging Face's LlamaForCausalLM with the shapes of our LLaMA preset ``config``."""
    from autoparallel.models.hf import hf_llama

    return hf_llama(
        num_hidden_layers=config.n_layers,
        hidden_size=config.dim,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        intermediate_size=config.ffn_hidden,
        vocab_size=config.vocab_size,
        max_position_embeddings=max(seq, config.max_seq_len),
    )


@contextlib.contextmanager
def session(args, model, config, mesh, batch_sharded, mp_policy, **options) -> Iterator:
    """An AutoParallel session of the benchmark's model, batch sharded in and out."""
    with AutoParallel(
        model,
        lambda: torch.randint(0, config.vocab_size, (args.batch, args.seq)),
        mesh,
        mp_policy,
        hardware=args.hardware,
        time_limit_s=args.time_limit,
        **options,
    ) as autop:
        autop.add_input_constraints([batch_sharded])
        if autop.stage_setup is None:  # with pp the cut pins the first stage's outputs
            autop.add_output_constraints([batch_sharded])
        yield autop


def halfway_budget(args, model, config, mesh, batch_sharded, mp_policy) -> tuple[dict, float]:
    """Plan without a memory constraint; the budget halfway between that plan's peak and the
    smallest peak any plan could reach recomputing every layer (a lower bound), in bytes."""
    from autoparallel.problem.memory import build_memory_model, smallest_peak

    start = time.perf_counter()
    with session(args, model, config, mesh, batch_sharded, mp_policy) as autop:
        free = autop.optimize_placement()
        smallest = smallest_peak(
            build_memory_model(autop.sharding_optimizer.problem, "adamw", True)
        )
    reference = {
        "reference_s": round(time.perf_counter() - start, 2),
        "reference_peak_gib": round(free.memory.peak / 2**30, 3),
        "reference_objective_us": round(free.solver.objective, 2),
        "smallest_peak_gib": round(smallest / 2**30, 3),
    }
    return reference, (free.memory.peak + smallest) / 2


def gib_or_bytes(text: str) -> float:
    """``--memory-budget`` in bytes: a bare number is GiB, else a byte count with its unit."""
    try:
        return float(text) * 2**30
    except ValueError:
        return parse_bytes(text, "--memory-budget", "halfway, GiB or ")


def unfolded_size(problem) -> tuple[int, int]:
    """(variables, constraints) the problem would have without folding, without building it."""
    space, tables = problem.space, problem.tables
    variables = sum(len(ns.strategies) for ns in space.nodes.values()) + sum(
        len(e.pairs) for e in tables.edges
    )
    constraints = len(space.nodes) + sum(
        len(e.src_options) + len(e.dst_options) for e in tables.edges
    )
    return variables, constraints


def pipeline_fields(plan, stages: dict) -> dict:
    """With pipeline stages: the setting kept, the predicted step and bubble, the largest
    stage peak (the plan's own peak is stage 0's) and the time the cut took."""
    pipeline = plan.pipeline if plan is not None else None
    if pipeline is None:
        return {}
    peaks = [m.peak for m in pipeline.stage_memory if m is not None]
    return {
        "pipeline": f"{pipeline.schedule}, {pipeline.microbatches} microbatches",
        "stages": pipeline.num_stages,
        "pipeline_step_ms": round(pipeline.cost.step_us / 1e3, 2) if pipeline.cost else None,
        "pipeline_bubble_ms": round(pipeline.cost.bubble_us / 1e3, 2) if pipeline.cost else None,
        "largest_stage_peak_gib": round(max(peaks) / 2**30, 3) if peaks else None,
        "cut_s": round(stages.get("cut", 0.0), 2),
    }


def question(args: argparse.Namespace) -> str:
    """The results key of a run: the model and mesh, then every setting off its default."""
    parts = [args.model, args.mesh]
    if args.mesh_names is not None:
        parts.append(args.mesh_names.replace(",", ""))
    if args.layers is not None:
        parts.append(f"layers{args.layers}")
    if args.batch != 8 or args.seq != 2048:
        parts.append(f"b{args.batch}s{args.seq}")
    if args.mixed_precision:
        parts.append("bf16")
    if args.memory_budget is not None:
        parts.append(f"budget-{args.memory_budget}")
    if args.activation_checkpointing != "off":
        parts.append(f"ac-{args.activation_checkpointing}")
    if args.hardware != "h100":
        parts.append("profile" if args.hardware.endswith(".json") else args.hardware)
    if args.trace_all_layers:
        parts.append("trace-all-layers")
    if args.no_fold:
        parts.append("unfolded")
    if args.no_lp_first:
        parts.append("no-lp-first")
    return "-".join(parts)


def describe(args: argparse.Namespace, layers: int) -> str:
    """One line saying what a run planned."""
    budget = (
        "parameter memory constraint"
        if args.memory_budget is None
        else f"memory budget {args.memory_budget}"
        + ("" if args.memory_budget == "halfway" else " GiB")
    )
    extras = [
        "bf16 policy" if args.mixed_precision else "",
        f"recomputation {args.activation_checkpointing}"
        if args.activation_checkpointing != "off"
        else "",
        "every layer traced" if args.trace_all_layers else "",
        "unfolded" if args.no_fold else "",
        f"priced on {args.hardware}",
    ]
    return ", ".join(
        [
            f"planning time, {args.model}, {layers} layers, mesh {args.mesh}"
            + (f" ({args.mesh_names.replace(',', ', ')})" if args.mesh_names else "")
            + f", {budget}"
        ]
        + [extra for extra in extras if extra]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="llama3-8b",
        help="llama3-8b, llama3-70b or tiny; hf-llama3-8b etc. for Hugging Face's model; "
        "moe-tiny or moe-16b",
    )
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument(
        "--mesh-names",
        default=None,
        help="comma-separated dim names; a first dim named pp plans pipeline stages (the "
        "batch then split over the dim after it)",
    )
    parser.add_argument("--layers", type=int, default=None, help="default: the model's own depth")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--no-fold", action="store_true", help="solve the unreduced problem")
    parser.add_argument(
        "--trace-all-layers",
        action="store_true",
        help="trace every layer instead of building the graph from 3 and 4",
    )
    parser.add_argument(
        "--time-limit", type=float, default=600.0, help="solver time limit, seconds"
    )
    parser.add_argument(
        "--no-lp-first",
        action="store_true",
        help="run the MIP without trying its LP relaxation first",
    )
    parser.add_argument(
        "--build-only", action="store_true", help="stop before solving (stage times and sizes only)"
    )
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="the whole step's peak per device (AdamW) instead of the parameter memory "
        "constraint: GiB (80) or bytes with a unit as `autoparallel plan` takes them (80GiB); "
        "or halfway (see above)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        choices=("off", "auto", "all"),
        default="off",
        help="what the memory budget may recompute (AutoParallel.add_memory_constraint)",
    )
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="bf16 parameters and compute, fp32 gradient reductions (MixedPrecisionPolicy)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="log the planner's steps (each LP, price search and refit, with its time) to stderr",
    )
    args = parser.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(message)s")
        logging.getLogger("autoparallel").setLevel(logging.DEBUG)

    shape = tuple(int(s) for s in args.mesh.split("x"))
    moe = args.model in MOE_MODELS
    names = tuple(args.mesh_names.split(",")) if args.mesh_names else None
    mesh = fake_mesh(shape, names or (MOE_MESH_NAMES[len(shape)] if moe else None))
    pipelined = names is not None and names[0] == "pp"
    overrides = {} if args.layers is None else {"n_layers": args.layers}
    with torch.device("meta"):
        if moe:
            config = moe_config(args.model, **overrides)
            model = MoETransformer(config)
        else:
            config = llama_config(args.model.removeprefix("hf-"), **overrides)
            model = (
                hf_llama_like(config, args.seq) if args.model.startswith("hf-") else Llama(config)
            )
    batch_sharded = (Shard(0),) + (Replicate(),) * (len(shape) - 1)
    if pipelined:  # whole microbatches between stages, rows over the dim after pp
        batch_sharded = (Replicate(),) + batch_sharded[:-1] if len(shape) > 1 else (Replicate(),)

    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.mixed_precision
        else None
    )
    reference, budget = {}, None
    if args.memory_budget == "halfway":
        reference, budget = halfway_budget(args, model, config, mesh, batch_sharded, mp_policy)
    elif args.memory_budget is not None:
        budget = gib_or_bytes(args.memory_budget)

    start = time.perf_counter()
    with session(
        args,
        model,
        config,
        mesh,
        batch_sharded,
        mp_policy,
        fold=not args.no_fold,
        trace_layers_once=not args.trace_all_layers,
    ) as autop:
        if budget is None:
            autop.add_parameter_memory_constraint()
        else:
            autop.add_memory_constraint(
                budget, activation_checkpointing=args.activation_checkpointing
            )
        if args.no_lp_first:
            optimizer = autop.sharding_optimizer
            optimizer.options = dataclasses.replace(optimizer.options, lp_first=False)
        plan = None if args.build_only else autop.optimize_placement()
        problem = autop.sharding_optimizer.problem
        total = time.perf_counter() - start
        stages = dict(autop.stage_times_s)  # the plan's own, before the every-layer solve
        every_layer = None
        if plan is not None and budget is not None and args.activation_checkpointing == "auto":
            autop.add_memory_constraint(budget, activation_checkpointing="all")
            every_layer = autop.optimize_placement()
    variables_before, constraints_before = unfolded_size(problem)
    line = {
        "model": args.model,
        "layers": config.n_layers,
        "mesh": list(shape),
        "batch": args.batch,
        "seq": args.seq,
        "fold": not args.no_fold,
        "layers_traced_once": problem.joint.layers_traced_once is not None,
        "trace_s": round(stages["trace"], 2),
        "strategies_s": round(stages["strategies"], 2),
        "cost_s": round(stages["cost"], 2),
        "fold_s": round(stages.get("fold", 0.0), 2),
        "build_s": round(stages["build"], 2),
        "solve_s": round(stages.get("solve", 0.0), 2),
        "total_s": round(total, 2),
        "nodes": len(problem.space.nodes),
        "node_classes": problem.folding.num_classes
        if problem.folding
        else len(problem.space.nodes),
        "variables_before_folding": variables_before,
        "constraints_before_folding": constraints_before,
        "variables": problem.num_variables,
        "constraints": problem.num_constraints,
        "edges": len(problem.tables.edges),
        "edges_as_route_flows": problem.edge_encodings.count("routes"),
        "objective_us": round(plan.solver.objective, 2) if plan else None,
        "solver_status": plan.solver.status if plan else "not solved (--build-only)",
        "solved_by": plan.solver.method if plan else None,
        "memory_budget_gib": round(budget / 2**30, 3) if budget else None,
        "predicted_peak_gib": round(plan.memory.peak / 2**30, 3) if plan else None,
        "mixed_precision": args.mixed_precision,
        "activation_checkpointing": args.activation_checkpointing,
        "recomputed_layers": len(plan.recompute) if plan else None,
        "recompute_us": round(plan.memory.recompute_us, 1) if plan else None,
        "every_layer_objective_us": round(every_layer.solver.objective, 2) if every_layer else None,
        "every_layer_recomputed": len(every_layer.recompute) if every_layer else None,
        **reference,
        "param_placements": sorted({str(p) for p in plan.param_placements.values()})
        if plan
        else None,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        **pipeline_fields(plan, stages),
    }
    print(json.dumps(line))
    if plan is not None:
        record(
            "plan_time",
            {
                "question": question(args),
                "what": describe(args, config.n_layers),
                "figure": line["total_s"],
                "unit": "s",
                **line,
            },
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
