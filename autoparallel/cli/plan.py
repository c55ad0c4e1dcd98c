"""Command line: ``autoparallel plan`` plans a model on a fake mesh and reports the plan.

Nothing is allocated and nothing communicates: the model is built on the meta device and the
mesh lives on torch's fake process group, so a 64-GPU plan can be made on a laptop. The plan
is printed as a summary (identical ``layers.N`` groups collapsed into one line) and can be
written as JSON (``--out``) and as a self-contained HTML page (``--html``). With ``--out`` the
whole problem is saved too (``plan.npz`` next to ``plan.json``, or the ``--save`` path), and the
JSON names it, so ``autoparallel explain plan.json --placement ...`` can price other choices.

Contract: :func:`main` returns 0 on success; bad arguments print ONE line on stderr and exit
with status 2 (argparse's convention), before any tracing starts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from autoparallel.cli import calibrate, saved
from autoparallel.cli.common import UsageError, parse_bytes, parse_mesh
from autoparallel.report.text import summary_lines

__all__ = ["build_parser", "main"]

LLAMA_PRESETS = ("llama3-8b", "llama3-70b", "tiny")
MOE_PRESETS = ("moe-tiny", "moe-16b")
BUILTIN_MODELS = LLAMA_PRESETS + MOE_PRESETS + ("gpt2",)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""--param-dtype / --reduce-dtype names -> torch dtype attribute names (torch loads lazily)."""
DEFAULT_MESH_NAMES = ("dp", "tp", "cp", "ep")

_PLAN_EPILOG = """\
models:
  llama3-8b, llama3-70b, tiny   the LLaMA-style reference model (autoparallel.models.Llama), all
                                its layers unless --layers says (identical layers are traced once
                                and folded: all 80 layers of llama3-70b on 8x8 plan in seconds)
  moe-tiny, moe-16b             the mixture-of-experts reference model (autoparallel.models.moe):
                                its routed experts are split over the mesh dim named "ep"
                                (give --mesh-names, e.g. dp,ep); all layers unless --layers says
  gpt2                          a small Hugging Face GPT-2, 2 layers unless --layers says (needs
                                `transformers`)
  package.module:factory        factory() is called on the meta device and returns either
                                an nn.Module fed token ids [batch, seq], or
                                (module, input_fn) with input_fn(batch, seq) -> global inputs

Inputs and outputs whose first dimension is the batch are constrained to be sharded on
the first mesh dimension, (S(0), R, ...). Costs are printed in microseconds (us).

example:
  autoparallel plan --model llama3-8b --mesh 8x8 --mesh-names dp,tp --batch 16 \\
      --seq 8192 --hardware h100 --gpus-per-node 8 --out plan.json --html plan.html
"""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line on stderr (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# ---------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="autoparallel", description="Automatic parallelization of PyTorch models."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plan = commands.add_parser(
        "plan",
        help="plan a model on a fake device mesh and report the plan",
        description="Plan a model on a fake device mesh (nothing is allocated) and report the plan.",
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "--model",
        required=True,
        help="llama3-8b | llama3-70b | tiny | moe-tiny | moe-16b | gpt2 | package.module:factory",
    )
    plan.add_argument(
        "--mesh", required=True, help="mesh shape, e.g. 8x8 (row-major; the last dim is innermost)"
    )
    plan.add_argument(
        "--mesh-names",
        default=None,
        help="comma-separated mesh dim names, one per dim (default: dp,tp,cp,ep truncated)",
    )
    plan.add_argument(
        "--batch",
        type=int,
        required=True,
        help="global batch size (divisible by the first mesh dim)",
    )
    plan.add_argument("--seq", type=int, required=True, help="sequence length")
    plan.add_argument(
        "--hardware",
        default="h100",
        help="hardware preset (h100, a100, h200, b200, cpu; default h100) or a profile.json "
        "written by `autoparallel calibrate`",
    )
    plan.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks per node, decides inter-node dims (default: the profile's, else 8)",
    )
    plan.add_argument(
        "--layers",
        type=int,
        default=None,
        help="transformer blocks to plan (default: the model's own depth; 2 for gpt2)",
    )
    plan.add_argument(
        "--parameter-memory",
        default="default",
        help="parameter memory per device: none, default (as sharded as possible) or bytes "
        "(e.g. 2e9, 16GiB)",
    )
    plan.add_argument(
        "--memory-budget",
        default="none",
        help="peak memory per device of a training step (parameters, gradients, optimizer "
        "state, saved activations, gathered parameters): none, device (the hardware's memory "
        "size) or bytes (e.g. 40GiB)",
    )
    plan.add_argument(
        "--optimizer",
        default="adamw",
        help="the optimizer state --memory-budget counts: adamw, adam, sgd, sgd-momentum, "
        "or bytes per parameter element (default adamw)",
    )
    plan.add_argument(
        "--activation-checkpointing",
        choices=("off", "auto", "all"),
        default="off",
        help="with --memory-budget: auto lets the solver recompute layers in the backward "
        "where that is the cheapest way to fit, all recomputes every layer (default off: "
        "every activation saved)",
    )
    plan.add_argument(
        "--param-dtype",
        choices=sorted(DTYPES),
        default=None,
        help="mixed precision: compute in this dtype (parameters stay in their own)",
    )
    plan.add_argument(
        "--reduce-dtype",
        choices=sorted(DTYPES),
        default=None,
        help="mixed precision: reduce gradients in this dtype (default: the compute dtype)",
    )
    plan.add_argument("--out", type=Path, default=None, help="write the plan as JSON here")
    plan.add_argument(
        "--html", type=Path, default=None, help="write a self-contained HTML report here"
    )
    saving = plan.add_mutually_exclusive_group()
    saving.add_argument(
        "--save",
        type=Path,
        default=None,
        help="save the whole problem and its solution (.npz) here for `autoparallel explain/diff` "
        "(default with --out: next to the JSON, e.g. plan.json -> plan.npz)",
    )
    saving.add_argument(
        "--no-save",
        action="store_true",
        help="with --out, do not save the problem (explain --placement/--costs then cannot run)",
    )
    plan.add_argument(
        "--trace-all-layers",
        action="store_true",
        help="trace every layer instead of building identical layers' graph from 3 and 4 traced ones",
    )
    plan.add_argument("--verbose", action="store_true", help="log every node's decision")
    saved.add_commands(commands)
    calibrate.add_commands(commands)
    return parser


@dataclass(frozen=True)
class PlanRequest:
    """The validated arguments of ``autoparallel plan``."""

    model: str
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...] | None
    batch: int
    seq: int
    hardware: str
    gpus_per_node: int | None
    layers: int | None
    parameter_memory: str | float | None  # None: no constraint; "default"; or bytes
    out: Path | None
    html: Path | None
    verbose: bool
    save: Path | None = None
    param_dtype: str | None = None  # a key of DTYPES
    reduce_dtype: str | None = None
    trace_all_layers: bool = False
    memory_budget: float | None = None  # peak bytes per device of a step; None: no constraint
    optimizer: str | float = "adamw"
    activation_checkpointing: str = "off"  # "auto": the memory constraint may recompute

    def mp_policy(self) -> Any:
        """torch's MixedPrecisionPolicy for the dtype flags, or None without them."""
        if self.param_dtype is None and self.reduce_dtype is None:
            return None
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        def dtype(name: str | None) -> Any:
            return getattr(torch, DTYPES[name]) if name else None

        return MixedPrecisionPolicy(
            param_dtype=dtype(self.param_dtype), reduce_dtype=dtype(self.reduce_dtype)
        )


def parse_mesh_names(text: str | None, ndim: int) -> tuple[str, ...] | None:
    if text is None:
        return DEFAULT_MESH_NAMES[:ndim] if ndim <= len(DEFAULT_MESH_NAMES) else None
    names = tuple(n.strip() for n in text.split(","))
    if len(names) != ndim:
        raise UsageError(
            f"--mesh-names gives {len(names)} name(s) ({text}) for a {ndim}-D mesh; give one per dim"
        )
    if any(not n.isidentifier() for n in names) or len(set(names)) != len(names):
        raise UsageError(f"--mesh-names {text!r}: names must be distinct identifiers, e.g. dp,tp")
    return names


def parse_parameter_memory(text: str) -> str | float | None:
    key = text.strip().lower()
    if key == "none":
        return None
    if key == "default":
        return "default"
    return parse_bytes(text, "--parameter-memory", "none, default or ")


def parse_memory_budget(text: str, hardware: str) -> float | None:
    """--memory-budget: None, the hardware's memory size ("device") or bytes."""
    key = text.strip().lower()
    if key == "none":
        return None
    if key == "device":
        from autoparallel.cost.hardware import HARDWARE_PRESETS
        from autoparallel.cost.profile import load_profile

        found = HARDWARE_PRESETS.get(hardware)
        return float((found or load_profile(hardware)).memory_bytes)
    return parse_bytes(text, "--memory-budget", "none, device or ")


def parse_optimizer(text: str) -> str | float:
    from autoparallel.types.memory import OPTIMIZERS

    key = text.strip().lower()
    if key in OPTIMIZERS:
        return key
    try:
        value = float(key)
    except ValueError:
        value = -1.0
    if value < 0:
        raise UsageError(
            f"--optimizer {text!r}: give one of {', '.join(OPTIMIZERS)}, or the optimizer "
            "state's bytes per parameter element (e.g. 8)"
        )
    return value


def _hardware(text: str) -> str:
    """A preset name, or the path of a profile that loads; UsageError otherwise."""
    from autoparallel.cost.hardware import HARDWARE_PRESETS
    from autoparallel.cost.profile import ProfileError, load_profile

    if text.strip().endswith(".json"):
        try:
            load_profile(text.strip())
        except ProfileError as error:
            raise UsageError(f"--hardware: {error}") from error
        return text.strip()
    hardware = text.strip().lower()
    if hardware not in HARDWARE_PRESETS:
        raise UsageError(
            f"--hardware {text!r} is not a known preset; choose one of "
            f"{', '.join(sorted(HARDWARE_PRESETS))}, or give a profile.json from `autoparallel calibrate`"
        )
    return hardware


def validate(args: argparse.Namespace) -> PlanRequest:
    """Check everything that can be checked before building the model; UsageError if wrong."""
    shape = parse_mesh(args.mesh)
    names = parse_mesh_names(args.mesh_names, len(shape))
    for flag, value in (
        ("--batch", args.batch),
        ("--seq", args.seq),
        ("--gpus-per-node", 1 if args.gpus_per_node is None else args.gpus_per_node),
    ):
        if value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    if args.layers is not None and args.layers < 1:
        raise UsageError(f"--layers must be a positive integer, got {args.layers}")
    hardware = _hardware(args.hardware)
    if args.batch % shape[0]:
        raise UsageError(
            f"--batch {args.batch} is not divisible by the first mesh dim ({shape[0]}), which shards the batch"
        )
    model = args.model.strip()
    if model.lower() in BUILTIN_MODELS:
        model = model.lower()
    elif ":" not in model:
        raise UsageError(
            f"--model {args.model!r} is not one of {', '.join(BUILTIN_MODELS)} or package.module:factory"
        )
    elif args.layers is not None:
        raise UsageError(
            "--layers applies to the built-in models only; a factory decides its own depth"
        )
    layers = args.layers
    save = None if args.no_save else args.save or default_problem_path(args.out)
    if save is not None and args.out is not None and save.resolve() == args.out.resolve():
        raise UsageError(
            f"--save {save} and --out {args.out} name the same file; the problem needs a file of its own"
        )
    if args.reduce_dtype is not None and args.param_dtype is None:
        raise UsageError("--reduce-dtype needs --param-dtype (the dtype the model computes in)")
    memory_budget = parse_memory_budget(args.memory_budget, hardware)
    if args.activation_checkpointing != "off" and memory_budget is None:
        raise UsageError(
            f"--activation-checkpointing {args.activation_checkpointing} needs --memory-budget: "
            "recomputing pays only to fit a budget"
        )
    return PlanRequest(
        model,
        shape,
        names,
        args.batch,
        args.seq,
        hardware,
        args.gpus_per_node,
        layers,
        parse_parameter_memory(args.parameter_memory),
        args.out,
        args.html,
        args.verbose,
        save,
        args.param_dtype,
        args.reduce_dtype,
        args.trace_all_layers,
        memory_budget,
        parse_optimizer(args.optimizer),
        args.activation_checkpointing,
    )


def default_problem_path(out: Path | None) -> Path | None:
    """Where ``--out plan.json`` saves its problem when ``--save`` does not say: ``plan.npz``
    in the same folder (``plan.json.npz`` if ``--out`` itself ends in ``.npz``)."""
    if out is None:
        return None
    path = out.with_suffix(".npz")
    return path if path != out else out.with_name(out.name + ".npz")


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
        built = factory()
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


def _batch_constraints(nodes: Sequence[Any], batch: int, ndim: int) -> list[Any]:
    """(S(0), R, ...) for every tensor whose first dim is the batch; None (free) otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    sharded = (Shard(0),) + (Replicate(),) * (ndim - 1)
    out = []
    for node in nodes:
        value = node.meta.get("val") if node is not None else None
        shape = getattr(value, "shape", None)
        out.append(
            sharded if shape is not None and len(shape) >= 1 and int(shape[0]) == batch else None
        )
    return out


def run_plan(request: PlanRequest) -> tuple[dict[str, Any], Any]:
    """Plan on a fake process group; returns (plan JSON dict, Plan). Destroys the group after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoparallel import AutoParallel

    model, input_fn = build_model(request)
    dist.init_process_group(
        "fake", store=FakeStore(), rank=0, world_size=math.prod(request.mesh_shape)
    )
    try:
        mesh = init_device_mesh("cpu", request.mesh_shape, mesh_dim_names=request.mesh_names)
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
            joint = autop.sharding_optimizer.problem.joint
            ndim = len(request.mesh_shape)
            autop.add_input_constraints(_batch_constraints(joint.user_inputs, request.batch, ndim))
            outputs = [joint.tangents.get(i, out) for i, out in enumerate(joint.user_outputs)]
            autop.add_output_constraints(_batch_constraints(outputs, request.batch, ndim))
            if request.parameter_memory == "default":
                autop.add_parameter_memory_constraint()
            elif request.parameter_memory is not None:
                autop.add_parameter_memory_constraint(high=float(request.parameter_memory))
            if request.memory_budget is not None:
                autop.add_memory_constraint(
                    request.memory_budget, request.optimizer, request.activation_checkpointing
                )
            plan = autop.optimize_placement(verbose=request.verbose)
            elapsed = time.perf_counter() - start
            if request.save is not None:
                autop.sharding_optimizer.save(str(request.save))
            data = plan_data(autop)
        data["run"] = _run_info(request, _depth(request, model), autop.stage_times_s, elapsed)
        traced_once = autop.joint.layers_traced_once if autop.joint is not None else None
        data["run"]["layers_traced_once"] = traced_once.path if traced_once is not None else None
        return data, plan
    finally:
        dist.destroy_process_group()


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


def plan_data(autop: Any) -> dict[str, Any]:
    """The optimizer's full plan JSON (``get_json``)."""
    return dict(autop.sharding_optimizer.get_json())


# ---------------------------------------------------------------------------- entry point


def _plan_command(request: PlanRequest) -> int:
    logging.basicConfig(
        level=logging.INFO if request.verbose else logging.WARNING, format="%(message)s"
    )
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


def _check_writable(path: Path | None, flag: str) -> None:
    if path is not None and not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {path.parent} does not exist")


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
        if args.command != "plan":
            return saved.run(args)
        request = validate(args)
        _check_writable(request.out, "--out")
        _check_writable(request.html, "--html")
        _check_writable(request.save, "--save")
        return _plan_command(request)
    except (UsageError, saved.SavedUsageError) as exc:
        message = " ".join(str(exc).split())  # one line, whatever a wrapped error said
        print(f"autoparallel {args.command}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `autoparallel explain plan.json | head`: the reader left
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush stays quiet
        return 0


if __name__ == "__main__":
    sys.exit(main())
