"""Command line: ``autoparallel plan`` plans a model on a fake mesh and reports the plan.

Nothing is allocated and nothing communicates: the model is built on the meta device and the
mesh lives on torch's fake process group, so a 64-GPU plan can be made on a laptop. The plan
is printed as a summary (identical ``layers.N`` groups collapsed into one line) and can be
written as JSON (``--out``) and as a self-contained HTML page (``--html``). With ``--out`` the
whole problem is saved too (``plan.npz`` next to ``plan.json``, or the ``--save`` path), and the
JSON names it, so ``autoparallel explain plan.json --placement ...`` can price other choices.
The arguments are parsed and checked in :mod:`autoparallel.cli.plan_arguments`; this module
builds the model, plans it and writes what was asked for, and holds the entry point.

Contract: :func:`main` returns 0 on success; bad arguments print ONE line on stderr and exit
with status 2 (argparse's convention), before any tracing starts. An error of autoparallel's
own types raised later (constraints no plan meets, a model that cannot be traced) and a
factory that raises are printed the same way, one line, status 2.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from autoparallel.cli import calibrate, export, saved
from autoparallel.cli.common import UsageError
from autoparallel.cli.plan_arguments import (
    BUILTIN_MODELS,
    LLAMA_PRESETS,
    MOE_PRESETS,
    PlanRequest,
    build_parser,
    validate,
)
from autoparallel.report.summary import summary_lines

__all__ = ["main"]


# ---------------------------------------------------------------------------- model building


def build_model(request: PlanRequest) -> tuple[Any, Callable[[], Any]]:
    """The model on the meta device and an ``input_fn`` giving its global example inputs."""
    import torch

    if request.model in LLAMA_PRESETS:
        return _llama(request)
    if request.model in MOE_PRESETS:
        return _moe(request)
    if request.model == "gpt2":
        from autoparallel.models import hf_gpt2

        with torch.device("meta"):
            depth = {} if request.layers is None else {"n_layer": request.layers}
            model = hf_gpt2(n_positions=max(128, request.seq), **depth)
        return model, _token_input(request, model.model.config.vocab_size)
    return _factory_model(request)


def _llama(request: PlanRequest) -> tuple[Any, Callable[[], Any]]:
    from autoparallel.models import Llama, llama_config

    return _reference_model(request, llama_config, Llama)


def _moe(request: PlanRequest) -> tuple[Any, Callable[[], Any]]:
    from autoparallel.models.moe import MoETransformer, moe_config

    return _reference_model(request, moe_config, MoETransformer)


def _reference_model(
    request: PlanRequest, config_of: Callable[..., Any], model_class: type
) -> tuple[Any, Callable[[], Any]]:
    """A reference model of the preset ``request.model`` (``--layers`` overriding its
    depth) on the meta device, fed token ids."""
    import torch

    config = config_of(
        request.model, **({} if request.layers is None else {"n_layers": request.layers})
    )
    if request.seq > config.max_seq_len:
        raise UsageError(
            f"--seq {request.seq} exceeds {request.model}'s max_seq_len {config.max_seq_len}"
        )
    with torch.device("meta"):
        model = model_class(config)
    return model, _token_input(request, config.vocab_size)


def _token_input(request: PlanRequest, vocab_size: int) -> Callable[[], Any]:
    """Global token ids [batch, seq] (values do not matter: tracing sees shapes only)."""
    import torch

    def input_fn() -> Any:
        return torch.randint(0, max(1, vocab_size), (request.batch, request.seq))

    return input_fn


def _factory_model(request: PlanRequest) -> tuple[Any, Callable[[], Any]]:
    import torch
    import torch.nn as nn

    module_name, _, attr = request.model.partition(":")
    try:
        factory: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(f"--model {request.model!r}: cannot import the factory ({exc})") from None
    if not callable(factory):
        raise UsageError(f"--model {request.model!r} is not callable")
    with torch.device("meta"):
        try:
            built = factory()
        except Exception as exc:  # the user's factory: its failure is reported as one line
            raise UsageError(
                f"--model {request.model!r}: calling the factory raised {type(exc).__name__}: {exc}"
            ) from exc
    if isinstance(built, nn.Module):
        vocab = getattr(getattr(built, "config", None), "vocab_size", None) or getattr(
            built, "vocab_size", 2
        )
        return built, _token_input(request, int(vocab))
    if (
        isinstance(built, tuple)
        and len(built) == 2
        and isinstance(built[0], nn.Module)
        and callable(built[1])
    ):
        model, make_inputs = built
        return model, lambda: make_inputs(request.batch, request.seq)
    raise UsageError(
        f"--model {request.model!r}: the factory must return an nn.Module or (module, input_fn)"
    )


# ---------------------------------------------------------------------------- planning


def run_plan(request: PlanRequest) -> tuple[dict[str, Any], Any]:
    """Plan on a fake process group; returns (plan JSON dict, Plan). Destroys the group after."""
    import torch.distributed as dist

    from autoparallel import InfeasibleConstraintsError, fake_mesh

    model, input_fn = build_model(request)
    mesh = fake_mesh(request.mesh_shape, request.mesh_names)
    try:
        return _planned(request, model, input_fn, mesh)
    except InfeasibleConstraintsError as error:
        flags = [_CONSTRAINT_FLAGS.get(name.split(":")[0], name) for name in error.conflict]
        detail = " ".join(str(error).split())
        raise UsageError(f"no plan meets {', '.join(dict.fromkeys(flags))}: {detail}") from error
    finally:
        dist.destroy_process_group()


_CONSTRAINT_FLAGS = {
    "memory": "--memory-budget",
    "parameter_memory": "--parameter-memory",
    "input": "--batch (inputs sharded on the batch)",
    "output": "--batch (outputs sharded on the batch)",
}
"""The flag behind each constraint the plan command adds, to name in an infeasible plan."""


def _planned(
    request: PlanRequest, model: Any, input_fn: Callable[[], Any], mesh: Any
) -> tuple[dict[str, Any], Any]:
    """Plan ``model`` on ``mesh`` as ``request`` says; (plan JSON dict, Plan)."""
    from autoparallel import AutoParallel

    start = time.perf_counter()
    with AutoParallel(
        model,
        input_fn,
        mesh,
        request.mp_policy(),
        hardware=request.hardware,
        gpus_per_node=request.gpus_per_node,
        trace_layers_once=not request.trace_all_layers,
    ) as autop:
        if (request.schedule, request.microbatches, request.stages_per_rank) != (None,) * 3:
            autop.add_pipeline_constraint(
                request.schedule, request.microbatches, stages_per_rank=request.stages_per_rank
            )
        joint = autop.sharding_optimizer.problem.joint
        outputs = [joint.tangents.get(i, out) for i, out in enumerate(joint.user_outputs)]
        autop.add_input_constraints(_batch_split(autop, joint.user_inputs, request.batch))
        if autop.stage_setup is None:  # with pp these are the first stage's, pinned by the cut
            autop.add_output_constraints(_batch_split(autop, outputs, request.batch))
        if request.parameter_memory == "default":
            autop.add_parameter_memory_constraint()
        elif request.parameter_memory is not None:
            autop.add_parameter_memory_constraint(high=float(request.parameter_memory))
        if request.memory_budget is not None:
            autop.add_memory_constraint(
                request.memory_budget, request.optimizer, request.activation_checkpointing
            )
        plan = autop.optimize_placement(verbose=request.verbose)
        if request.torch_styles:
            plan = _within_torch_styles(request, autop, plan)
        elapsed = time.perf_counter() - start
        if request.save is not None:
            autop.sharding_optimizer.save(str(request.save))
        data = plan_data(autop)
    data["run"] = _run_info(request, _depth(request, model), autop.stage_times_s, elapsed)
    traced_once = autop.joint.layers_traced_once if autop.joint is not None else None
    data["run"]["layers_traced_once"] = traced_once.path if traced_once is not None else None
    return data, plan


def _within_torch_styles(request: PlanRequest, autop: Any, free: Any) -> Any:
    """The plan again within torch's styles (export/restrict.py): the batch is split on the
    first mesh dim (data parallel), the second is tensor parallel. ``fully_shard`` already
    shards every parameter on the data dim; the default parameter-memory constraint's
    1/world-size minimum is out of reach where norms stay whole on tp, so it goes, and the
    free plan the restriction is priced against is solved again without it."""
    from autoparallel.export import plan_in_torch_styles

    model_dim = 1 if len(request.mesh_shape) > 1 else None
    restricted = plan_in_torch_styles(
        autop.sharding_optimizer,
        free,
        0,
        model_dim,
        "replicate" if request.parameter_memory is None else "fully_shard",
        drop_parameter_memory=request.parameter_memory == "default" and model_dim is not None,
    )
    print(
        f"within torch's styles: predicted step {restricted.plan.totals.total_us / 1000:.3f} ms, "
        f"{100 * (restricted.cost_ratio - 1):+.1f} % against the free plan's "
        f"{free.totals.total_us / 1000:.3f} ms"
    )
    return restricted.plan


def _depth(request: PlanRequest, model: Any) -> int | None:
    """Layers planned: --layers, else the built-in model's own depth (None for a factory's)."""
    if request.layers is not None or request.model not in BUILTIN_MODELS:
        return request.layers
    if request.model == "gpt2":
        return int(model.model.config.n_layer)
    return len(model.layers)


def _run_info(
    request: PlanRequest, layers: int | None, stage_times_s: Mapping[str, float], elapsed_s: float
) -> dict[str, Any]:
    budget = request.parameter_memory
    return {
        "model": request.model,
        "layers": layers,
        "batch": request.batch,
        "seq": request.seq,
        "parameter_memory": "none"
        if budget is None
        else (budget if isinstance(budget, str) else f"{budget:.0f} bytes"),
        "memory_budget": "none"
        if request.memory_budget is None
        else f"{request.memory_budget:.0f} bytes",
        "optimizer": request.optimizer,
        "activation_checkpointing": request.activation_checkpointing,
        "param_dtype": request.param_dtype,
        "reduce_dtype": request.reduce_dtype,
        "stage_times_s": {k: round(float(v), 3) for k, v in stage_times_s.items()},
        "planning_s": round(elapsed_s, 3),
    }


def _batch_split(autop: Any, nodes: list[Any], batch: int | None) -> list[Any]:
    """The batch split over the first mesh dim; with a "pp" dim, over the first after it
    (Replicate on pp), the rows being a microbatch's."""
    from autoparallel.mesh_search import batch_placements, stage_batch_placements

    if autop.stage_setup is None:
        return batch_placements(nodes, batch, autop.mesh.ndim)
    return stage_batch_placements(autop, nodes, batch)


def plan_data(autop: Any) -> dict[str, Any]:
    """The optimizer's full plan JSON (``get_json``)."""
    return dict(autop.sharding_optimizer.get_json())


# ---------------------------------------------------------------------------- entry point


def _plan_command(request: PlanRequest) -> int:
    logging.basicConfig(
        level=logging.INFO if request.verbose else logging.WARNING, format="%(message)s"
    )
    if request.devices is not None:
        request = _searched(request)
    data, _ = run_plan(request)
    print("\n".join(summary_lines(data)))
    if request.out is not None:
        from autoparallel.files.plan_json import problem_reference
        from autoparallel.report.template import json_safe

        if request.save is not None:
            data["problem"] = problem_reference(request.save, request.out)
        text = json.dumps(json_safe(data), indent=1, allow_nan=False, default=str)
        request.out.write_text(text + "\n", encoding="utf-8")
        print(f"wrote {request.out}")
    if request.html is not None:
        from autoparallel.report import write_html

        write_html(data, request.html)
        print(f"wrote {request.html}")
    if request.save is not None:
        print(f"wrote {request.save}")
    return 0


def _searched(request: PlanRequest) -> PlanRequest:
    """``request`` on the mesh ``search_mesh`` ranks fastest for ``--devices``, after
    printing the ranked candidates (the winner is then planned again, for the full report)."""
    import dataclasses

    from autoparallel.mesh_search import MeshSearchError, search_mesh

    model, input_fn = build_model(request)
    try:
        found = search_mesh(
            model,
            input_fn,
            request.devices,
            request.gpus_per_node or 8,
            hardware=request.hardware,
            mp_policy=request.mp_policy(),
            parameter_memory=request.parameter_memory is not None,
            pipeline=request.pipeline,
        )
    except MeshSearchError as error:
        raise UsageError(str(error)) from error
    print(f"meshes of {request.devices} devices, fastest first:")
    print("\n".join(found.table()))
    best = found.best
    if best.fits is False:
        print(
            f"no mesh's predicted peak fits the device; the fastest, {best.mesh_text}, needs "
            f"{best.peak_memory_gib:.3g} GiB: try --memory-budget device with --mesh"
        )
    print(f"planning on {best.mesh_text}\n")
    return dataclasses.replace(request, mesh_shape=best.shape, mesh_names=best.names)


def _check_writable(path: Path | None, flag: str) -> None:
    """UsageError unless ``path`` can be written as a file: its folder exists and it is
    not a folder itself."""
    if path is not None and not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {path.parent} does not exist")
    if path is not None and path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name")


def _ours(exc: BaseException) -> bool:
    """An error of one of autoparallel's own types (an infeasible budget, a model that cannot
    be traced, a file that is not what it should be): a message for the user, not a bug."""
    return type(exc).__module__.split(".")[0] == "autoparallel"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autoparallel`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # --help (0) or an argparse error (2, already printed)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "calibrate":
            return calibrate.run(args)
        if args.command == "export":
            return export.run(args)
        if args.command != "plan":
            return saved.run(args)
        request = validate(args)
        _check_writable(request.out, "--out")
        _check_writable(request.html, "--html")
        _check_writable(request.save, "--save")
        return _plan_command(request)
    except BrokenPipeError:  # e.g. `autoparallel explain plan.json | head`: the reader left
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush stays quiet
        return 0
    except Exception as exc:
        if not isinstance(exc, (UsageError, saved.SavedUsageError)) and not _ours(exc):
            raise  # a bug: its traceback is what to report
        message = " ".join(str(exc).split())  # one line, whatever a wrapped error said
        print(f"autoparallel {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
