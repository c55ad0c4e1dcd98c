"""The ``autoparallel`` parser, and ``autoparallel plan``'s arguments checked into a request.

Everything here runs before the model is built: :func:`build_parser` (the ``plan`` command's
flags, with ``explain``, ``diff`` and ``calibrate`` added from their own modules) and
:func:`validate`, which turns the parsed flags into a :class:`PlanRequest` whose every value
has been checked (mesh, names, sizes, hardware preset or profile, memory figures, file
names). The planning itself (building the model, tracing, solving, writing the files) is in
:mod:`autoparallel.cli.plan`.

Contract: a bad argument raises :class:`~autoparallel.cli.common.UsageError` with a one-line
message (argparse's own errors print one line and exit with status 2), before any tracing
starts.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from autoparallel.cli import calibrate, export, saved
from autoparallel.cli.common import UsageError, parse_bytes, parse_mesh
from autoparallel.types.pipeline import SCHEDULES

__all__ = [
    "BUILTIN_MODELS",
    "LLAMA_PRESETS",
    "MOE_PRESETS",
    "PlanRequest",
    "build_parser",
    "validate",
]

LLAMA_PRESETS = ("llama3-8b", "llama3-70b", "llama3-405b", "tiny")
MOE_PRESETS = ("moe-tiny", "moe-16b")
BUILTIN_MODELS = LLAMA_PRESETS + MOE_PRESETS + ("gpt2",)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""--param-dtype / --reduce-dtype names -> torch dtype attribute names (torch loads lazily)."""
DEFAULT_MESH_NAMES = ("dp", "tp", "cp", "ep")

_PLAN_EPILOG = """\
models:
  llama3-8b, llama3-70b,        the LLaMA-style reference model (autoparallel.models.Llama), all
  llama3-405b, tiny             its layers unless --layers says (identical layers are traced once
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
        help="llama3-8b | llama3-70b | llama3-405b | tiny | moe-tiny | moe-16b | gpt2 | package.module:factory",
    )
    plan.add_argument(
        "--mesh", default=None, help="mesh shape, e.g. 8x8 (row-major; the last dim is innermost)"
    )
    plan.add_argument(
        "--devices",
        type=int,
        default=None,
        help="instead of --mesh: try every (dp,) and (dp, tp) mesh of this many devices (and "
        "(pp, ...) ones with --pipeline) "
        "(tp within a node of --gpus-per-node, default 8), print them ranked by predicted "
        "step time, and plan on the fastest",
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
        "--pipeline",
        action="store_true",
        help="with --devices: also try meshes whose first dim is pp (each plans its stages, "
        "microbatches and cuts: slower)",
    )
    plan.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="with a pp mesh dim: the pipeline schedule (default: 1f1b where there are at "
        "least as many microbatches as stages, else gpipe; interleaved-1f1b with two stages "
        "per rank is priced beside it)",
    )
    plan.add_argument(
        "--stages-per-rank",
        type=int,
        default=None,
        help="with a pp mesh dim: stages each pp rank runs (more than one: interleaved-1f1b)",
    )
    plan.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="with a pp mesh dim: microbatches per step (default: the planner prices every "
        "count from the stages to 4x that divides each rank's rows and keeps the fastest)",
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
    plan.add_argument(
        "--torch-styles",
        action="store_true",
        help="plan within what torch's fully_shard and tensor-parallel styles write (for "
        "`autoparallel export`), and print what that restriction costs",
    )
    saved.add_commands(commands)
    calibrate.add_commands(commands)
    export.add_commands(commands)
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
    devices: int | None = None  # search the mesh of this many devices (mesh_shape: its 1-D)
    schedule: str | None = None  # with a "pp" mesh dim: add_pipeline_constraint's
    microbatches: int | None = None
    pipeline: bool = False  # with devices: pp meshes among the candidates
    stages_per_rank: int | None = None
    torch_styles: bool = False  # plan within torch's styles (export/restrict.py)

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
    if not 0 <= value < math.inf:  # NaN and infinity too
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
    if (args.mesh is None) == (args.devices is None):
        raise UsageError("give either --mesh (e.g. 8x8) or --devices (e.g. 64), not both")
    if args.devices is not None:
        if args.devices < 1:
            raise UsageError(f"--devices must be a positive integer, got {args.devices}")
        if args.mesh_names is not None:
            raise UsageError("--mesh-names goes with --mesh; --devices names its dims dp,tp")
        if args.memory_budget.strip().lower() != "none":
            raise UsageError("--memory-budget is not searched over meshes yet: give --mesh")
    shape = parse_mesh(args.mesh) if args.mesh is not None else (args.devices,)
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
    if args.pipeline and args.devices is None:
        raise UsageError("--pipeline goes with --devices (with --mesh, name a pp dim)")
    pipelined = names is not None and names[0] == "pp"
    if (args.schedule or args.microbatches or args.stages_per_rank) and not pipelined:
        raise UsageError(
            "--schedule, --microbatches and --stages-per-rank need a mesh whose first dim is "
            "named pp"
        )
    for flag, value in (
        ("--microbatches", args.microbatches),
        ("--stages-per-rank", args.stages_per_rank),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    batch_dim = 1 if pipelined and len(shape) > 1 else 0  # pp moves whole microbatches
    if (
        args.devices is None
        and not (pipelined and len(shape) == 1)
        and args.batch % shape[batch_dim]
    ):
        raise UsageError(
            f"--batch {args.batch} is not divisible by mesh dim {batch_dim} ({shape[batch_dim]}), "
            "which shards the batch"
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
    if args.torch_styles and (args.devices is not None or len(shape) > 2 or "pp" in (names or ())):
        raise UsageError(
            "--torch-styles plans on a --mesh of one or two dims (data, then tensor parallel), "
            "without pp"
        )
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
        args.devices,
        args.schedule,
        args.microbatches,
        args.pipeline,
        args.stages_per_rank,
        args.torch_styles,
    )


def default_problem_path(out: Path | None) -> Path | None:
    """Where ``--out plan.json`` saves its problem when ``--save`` does not say: ``plan.npz``
    in the same folder (``plan.json.npz`` if ``--out`` itself ends in ``.npz``)."""
    if out is None:
        return None
    path = out.with_suffix(".npz")
    return path if path != out else out.with_name(out.name + ".npz")
