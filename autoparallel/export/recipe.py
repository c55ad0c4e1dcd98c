"""A plan read as torch's own parallelization recipe: FSDP2, tensor-parallel styles, recomputation.

The plan says, per parameter and per op, which placement each mesh dim gives it. torch's
hand-written recipes say the same with a few coarser words: ``fully_shard`` a module on the
data-parallel dim (every parameter of it sharded there, gathered for the compute), a
``ColwiseParallel`` / ``RowwiseParallel`` linear or embedding on the tensor-parallel dim,
``SequenceParallel`` norms, ``checkpoint_wrapper`` on recomputed layers. :func:`recipe_of`
maps each of the plan's choices onto those words where one fits and names, with the reason,
each choice no word expresses (:class:`Unexpressed`). It reads only the plan's plain data
(:class:`PlanView`, from a live :class:`Plan` or a plan JSON), never the model.

Mesh dims are read by what the plan does on them: a dim the model's first input is split on
by batch is data parallel, any other is tensor parallel. One of each is expressed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch.distributed.tensor import Replicate, Shard

from autoparallel.types.graph import layer_of
from autoparallel.types.placements import (
    Placements,
    PlacementSyntaxError,
    is_multi,
    parse_placements,
    placement_str,
)
from autoparallel.types.plan import ParameterUse, Plan

TensorParallelStyle = Literal["colwise", "rowwise", "sequence", "gather_input"]
"""torch's ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, and
``PrepareModuleInput`` gathering a module's split input whole."""

DataParallelStyle = Literal["fully_shard", "replicate", "none"]
"""FSDP2's ``fully_shard``, the composable DDP ``replicate``, or no data-parallel dim."""


@dataclass(frozen=True)
class PlanView:
    """What the export reads of a plan (a live :class:`Plan` or its JSON)."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    params: dict[str, Placements]
    uses: dict[str, ParameterUse]
    inputs: list[Placements | None]
    outputs: list[Placements | None]
    recompute: tuple[str, ...] = ()
    step_us: float | None = None
    priced_on: str = ""
    # (producer, consumer, from, to) of every move of the forward
    forward_moves: tuple[tuple[str, str, Placements, Placements], ...] = ()
    placeholders: frozenset[str] = frozenset()  # the graph's inputs: parameters, batch
    # (placeholder, from, to) of every move of a graph input the backward makes: a
    # parameter gathered again for the backward
    backward_reads: tuple[tuple[str, Placements, Placements], ...] = ()
    # the mixed-precision policy planned under: torch dtype names (param, reduce), or None
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    @classmethod
    def of(cls, plan: Plan) -> PlanView:
        names = plan.mesh_dim_names or tuple(f"dim{i}" for i in range(len(plan.mesh_shape)))
        return cls(
            mesh_shape=tuple(plan.mesh_shape),
            mesh_dim_names=tuple(names),
            params=dict(plan.param_placements),
            uses=dict(plan.parameter_uses),
            inputs=list(plan.input_placements),
            outputs=list(plan.output_placements),
            recompute=tuple(plan.recompute),
            step_us=plan.totals.total_us,
            priced_on=plan.priced_on,
            forward_moves=tuple(
                (arg.producer, consumer, arg.src, arg.dst)
                for consumer, arg in plan.redistributions()
                if plan.nodes[consumer].phase == "forward"
                and arg.kind == "arg"
                and not is_multi(arg.src)
                and not is_multi(arg.dst)
            ),
            placeholders=frozenset(n.name for n in plan.nodes.values() if n.phase == "placeholder"),
            backward_reads=tuple(
                (arg.producer, arg.src, arg.dst)
                for consumer, arg in plan.redistributions()
                if plan.nodes[consumer].phase == "backward"
                and plan.nodes.get(arg.producer) is not None
                and plan.nodes[arg.producer].phase == "placeholder"
                and not is_multi(arg.src)
                and not is_multi(arg.dst)
            ),
        )


def view_of_json(data: dict[str, Any], path: str = "plan JSON") -> PlanView:
    """The export's view of a plan JSON written by ``autoparallel plan --out`` (read with
    :func:`~autoparallel.files.plan_json.read_plan_json`); ExportError naming what is
    missing, e.g. a file written before the ``parameter_uses`` section existed."""
    uses = data.get("parameter_uses")
    if not isinstance(uses, dict) or not isinstance(data.get("inputs"), list):
        raise ExportError(
            f"{path} has no 'parameter_uses' or 'inputs' section: write it again with "
            "`autoparallel plan --out` of this version"
        )

    def read(text: Any, where: str) -> Placements | None:
        if text is None:
            return None
        try:
            return parse_placements(text)
        except (PlacementSyntaxError, TypeError) as error:
            raise ExportError(f"{path}: {where} is {text!r}: {error}") from error

    try:
        mesh = data["mesh"]
        names = mesh.get("dim_names") or [f"dim{i}" for i in range(len(mesh["shape"]))]
        return PlanView(
            mesh_shape=tuple(mesh["shape"]),
            mesh_dim_names=tuple(names),
            params={
                p["name"]: read(p["placements"], f"parameter {p['name']}")
                for p in data["parameters"]
            },
            uses={
                name: ParameterUse(
                    op=u["op"],
                    node=u["node"],
                    activation=read(u.get("activation"), f"{name}'s activation"),
                    feeds_output=bool(u.get("feeds_output")),
                    arrives=read(u.get("arrives"), f"{name}'s arrival"),
                    at_use=read(u.get("at_use"), f"{name}'s placement at use"),
                    leaves=read(u.get("leaves"), f"{name}'s result"),
                    boundary=tuple(u.get("boundary") or ()),
                    placeholder=u.get("placeholder") or "",
                )
                for name, u in uses.items()
            },
            inputs=[read(i.get("placements"), f"input {n}") for n, i in enumerate(data["inputs"])],
            outputs=[
                read(o.get("placements"), f"output {n}")
                for n, o in enumerate(data.get("outputs") or [])
            ],
            recompute=tuple((data.get("memory") or {}).get("recomputed") or ()),
            step_us=(data.get("totals") or {}).get("total_us"),
            priced_on=(data.get("totals") or {}).get("priced_on", ""),
            forward_moves=tuple(
                (c["producer"], c["consumer"], read(c["src"], "a move"), read(c["dst"], "a move"))
                for c in data.get("collectives") or ()
                if c.get("phase") == "forward" and "(" not in (c["src"][:1], c["dst"][:1])
            ),
            placeholders=frozenset(
                n["name"] for n in data.get("nodes") or () if n.get("phase") == "placeholder"
            ),
            backward_reads=tuple(
                (c["producer"], read(c["src"], "a move"), read(c["dst"], "a move"))
                for c in data.get("collectives") or ()
                if c.get("phase") == "backward"
                and c["producer"] in {u.get("placeholder") for u in uses.values()}
                and "(" not in (c["src"][:1], c["dst"][:1])
            ),
            param_dtype=_dtype_name((data.get("run") or {}).get("param_dtype")),
            reduce_dtype=_dtype_name((data.get("run") or {}).get("reduce_dtype")),
        )
    except (KeyError, TypeError, AttributeError) as error:
        raise ExportError(
            f"{path} is not a complete plan JSON ({error!r} missing or wrong)"
        ) from error


_SHORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _dtype_name(text: Any) -> str | None:
    """``bf16`` (the CLI's flag) or ``bfloat16`` -> ``bfloat16``; None for anything else."""
    if not isinstance(text, str):
        return None
    name = _SHORT_DTYPES.get(text, text)
    return name if name in _SHORT_DTYPES.values() else None


class ExportError(ValueError):
    """A plan the export cannot read, or options it cannot honour."""


@dataclass(frozen=True)
class ModuleStyle:
    """One ``parallelize_module`` entry: the module's path, its style, the layouts its
    input arrives in and its output leaves in (torch's defaults where None), and why."""

    module: str
    style: TensorParallelStyle
    input_layouts: str | None = None
    output_layouts: str | None = None
    use_local_output: bool = True
    why: str = ""


@dataclass(frozen=True)
class ShardedUnit:
    """One ``fully_shard`` call: the module (``""``: the root) and the parameters sharded on
    a dim other than 0 (``shard_placement_fn``)."""

    module: str
    shard_dims: dict[str, int] = field(default_factory=dict)
    # False where the plan keeps the layer's gathered parameters from its forward to its
    # backward (no re-gather): FSDP2's reshard_after_forward
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class Unexpressed:
    """A choice of the plan that torch's styles cannot write: the parameter or module, what
    the plan chose, and why no style fits."""

    name: str
    chosen: str
    why: str


@dataclass(frozen=True)
class TorchRecipe:
    """The plan as torch's recipe (see the module docstring)."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    data_dim: str | None
    model_dim: str | None
    data_parallel: DataParallelStyle
    units: tuple[ShardedUnit, ...]
    styles: tuple[ModuleStyle, ...]
    checkpointed: tuple[str, ...]
    loss_parallel: bool
    unexpressed: tuple[Unexpressed, ...]
    step_us: float | None = None
    priced_on: str = ""
    param_dtype: str | None = None
    reduce_dtype: str | None = None


def recipe_of(view: PlanView) -> TorchRecipe:
    """The plan ``view`` as torch's recipe, with every choice no style expresses named."""
    data_dims, model_dims = _dim_roles(view)
    unexpressed: list[Unexpressed] = []
    for extra in data_dims[1:] + model_dims[1:]:
        unexpressed.append(
            Unexpressed(
                view.mesh_dim_names[extra],
                "a second data or model dim",
                "the export writes one data-parallel and one tensor-parallel mesh dim",
            )
        )
    data = data_dims[0] if data_dims else None
    model = model_dims[0] if model_dims else None
    data_parallel, units = _data_parallel(view, data, unexpressed)
    styles, loss_parallel = _tensor_parallel(view, model, unexpressed)
    return TorchRecipe(
        mesh_shape=view.mesh_shape,
        mesh_dim_names=view.mesh_dim_names,
        data_dim=None if data is None else view.mesh_dim_names[data],
        model_dim=None if model is None else view.mesh_dim_names[model],
        data_parallel=data_parallel,
        units=units,
        styles=styles,
        checkpointed=tuple(layer.rstrip(".") for layer in view.recompute),
        loss_parallel=loss_parallel,
        unexpressed=tuple(unexpressed),
        step_us=view.step_us,
        priced_on=view.priced_on,
        param_dtype=view.param_dtype,
        reduce_dtype=view.reduce_dtype,
    )


def _dim_roles(view: PlanView) -> tuple[list[int], list[int]]:
    """(data-parallel dims, tensor-parallel dims): a dim the first input is split on by its
    batch (dim 0) is data parallel."""
    first = view.inputs[0] if view.inputs else None
    data = [
        dim for dim in range(len(view.mesh_shape)) if first is not None and first[dim] == Shard(0)
    ]
    return data, [dim for dim in range(len(view.mesh_shape)) if dim not in data]


# ---------------------------------------------------------------------------- data parallel


def _data_parallel(
    view: PlanView, dim: int | None, unexpressed: list[Unexpressed]
) -> tuple[DataParallelStyle, tuple[ShardedUnit, ...]]:
    """``fully_shard`` per numbered layer and at the root where the plan shards the
    parameters on the data dim; ``replicate`` where it keeps every one whole there."""
    if dim is None:
        return "none", ()
    name_of_dim = view.mesh_dim_names[dim]
    sharded: dict[str, Shard] = {}
    for name, placements in view.params.items():
        rest, used = placements[dim], _at_use(view, name)[dim]
        if isinstance(used, Shard):
            unexpressed.append(
                Unexpressed(
                    name,
                    placement_str(placements),
                    f"split for its compute on the data dim {name_of_dim}: "
                    "data parallelism splits the batch, not the parameters it computes with",
                )
            )
        elif isinstance(rest, Shard):
            sharded[name] = rest
    if not sharded:
        return "replicate", ()
    for name, placements in view.params.items():
        if name not in sharded and not isinstance(_at_use(view, name)[dim], Shard):
            unexpressed.append(
                Unexpressed(
                    name,
                    placement_str(placements),
                    f"whole on {name_of_dim} where the other parameters are sharded: "
                    "fully_shard shards every parameter of the modules it wraps",
                )
            )
    layers: dict[str, dict[str, int]] = {}
    for name, shard in sharded.items():
        layers.setdefault(layer_of(name).rstrip("."), {})
        if shard.dim != 0:
            layers[layer_of(name).rstrip(".")][name] = shard.dim
    regathered = _regathered_layers(view, dim)
    units = [
        ShardedUnit(layer, dims, layer in regathered) for layer, dims in layers.items() if layer
    ]
    units.append(ShardedUnit("", layers.get("", {})))
    return "fully_shard", tuple(units)


def _regathered_layers(view: PlanView, dim: int) -> set[str]:
    """The numbered layers the plan gathers a parameter of again for the backward (on the
    data dim): FSDP2 reshards those after the forward; the others keep their parameters."""
    placeholder_of = {use.placeholder: name for name, use in view.uses.items() if use.placeholder}
    layers = set()
    for placeholder, src, dst in view.backward_reads:
        name = placeholder_of.get(placeholder)
        if name is not None and isinstance(src[dim], Shard) and dst[dim] == Replicate():
            layers.add(layer_of(name).rstrip("."))
    return layers


# ---------------------------------------------------------------------------- tensor parallel


def _tensor_parallel(
    view: PlanView, dim: int | None, unexpressed: list[Unexpressed]
) -> tuple[tuple[ModuleStyle, ...], bool]:
    """One style per module whose parameter the plan splits on the model dim, the norms the
    plan runs on sequence shards, and whether the head leaves its logits split (a loss
    under ``loss_parallel``)."""
    if dim is None:
        return (), False
    sequence = _sequence_parallel(view, dim)
    _moves_between_modules(view, dim, unexpressed)
    styles: dict[str, ModuleStyle] = {}
    loss_parallel = False
    for name, use in view.uses.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" and not (use.op == "other" and _split(view.params[name], dim)):
            continue
        style = _style(view, name, use, dim, sequence, unexpressed)
        if style is None:
            continue
        styles[module] = style
        loss_parallel = loss_parallel or not style.use_local_output
    return tuple(styles.values()), loss_parallel


def _moves_between_modules(view: PlanView, dim: int, unexpressed: list[Unexpressed]) -> None:
    """Name each move on the model dim that the plan makes in the model's own code, away
    from every linear's and embedding's edges and from the parameters: torch's styles run
    that code on local shards and move nothing there."""
    edges = {node for use in view.uses.values() for node in use.boundary}
    for producer, consumer, src, dst in view.forward_moves:
        if src[dim] == dst[dim] or producer in edges or consumer in edges:
            continue
        if producer in view.placeholders:  # a parameter's own gathers are judged per parameter
            continue
        unexpressed.append(
            Unexpressed(
                f"{producer} -> {consumer}",
                f"{placement_str(src)} -> {placement_str(dst)}",
                f"moved on the model dim {view.mesh_dim_names[dim]} inside the model's own "
                "code: torch's styles move data only at a module's edges",
            )
        )


def _split(placements: Placements, dim: int) -> bool:
    return isinstance(placements[dim], Shard)


def _at_use(view: PlanView, name: str) -> Placements:
    """The parameter's placement as the forward reads it (at rest where unknown)."""
    use = view.uses.get(name)
    return view.params[name] if use is None or use.at_use is None else use.at_use


def _sequence_parallel(view: PlanView, dim: int) -> bool:
    """Whether the plan runs the norms on sequence shards of the model dim (Megatron's
    sequence parallelism): the residual stream then travels split by sequence."""
    return any(
        use.op == "scale" and use.activation is not None and use.activation[dim] == Shard(1)
        for use in view.uses.values()
    )


def _style(
    view: PlanView,
    name: str,
    use: ParameterUse,
    dim: int,
    sequence: bool,
    unexpressed: list[Unexpressed],
) -> ModuleStyle | None:
    placement = _at_use(view, name)[dim]
    module = name.rpartition(".")[0]
    activation = None if use.activation is None else use.activation[dim]
    stream = "Shard(1)" if sequence else "Replicate()"
    chosen = f"{placement_str(view.params[name])} (activation {placement_str(use.activation)})"

    def refuse(why: str) -> None:
        unexpressed.append(Unexpressed(name, chosen, why))

    if isinstance(view.params[name][dim], Shard) and placement == Replicate():
        refuse(
            f"sharded at rest on the model dim {view.mesh_dim_names[dim]} and gathered for its "
            "compute (ZeRO across that dim): the export shards parameters on the data dim only"
        )
        return None

    if use.op == "linear":
        arrives = _on(use.arrives, dim)
        leaves = _on(use.leaves, dim)
        if placement == Shard(0) and activation == Replicate():
            gathered = leaves == Replicate() or (use.feeds_output and _output_whole(view, dim))
            return ModuleStyle(
                module,
                "colwise",
                input_layouts=_layout(arrives) if isinstance(arrives, Shard) else None,
                output_layouts="Replicate()" if gathered else None,
                use_local_output=gathered or not use.feeds_output,
                why="weight split by output features, input whole"
                + (", output gathered" if gathered else ", output left split by features"),
            )
        if placement == Shard(1) and isinstance(activation, Shard):
            scattered = isinstance(leaves, Shard)
            return ModuleStyle(
                module,
                "rowwise",
                input_layouts="Replicate()" if arrives == Replicate() else None,
                output_layouts="Shard(1)" if scattered else "Replicate()",
                why="weight split by input features, input split the same way, partial sums "
                + ("reduce-scattered by sequence" if scattered else "all-reduced"),
            )
        if placement == Replicate() and activation == Replicate():
            if isinstance(arrives, Shard):
                return ModuleStyle(
                    module,
                    "gather_input",
                    input_layouts=_layout(arrives),
                    why="weight whole: its split input gathered first",
                )
            return None
        refuse(_linear_why(placement, activation))
        return None
    if use.op == "embedding":
        if placement == Replicate():
            return None
        style: TensorParallelStyle = "rowwise" if placement == Shard(0) else "colwise"
        return ModuleStyle(
            module,
            style,
            input_layouts="Replicate()",
            output_layouts=stream,
            why=f"embedding table split by {'vocabulary' if style == 'rowwise' else 'features'}",
        )
    if use.op == "scale":
        if placement != Replicate():
            refuse("a norm's weight split across the model dim: torch's styles keep it whole")
            return None
        if activation == Shard(1):
            return ModuleStyle(module, "sequence", why="norm run on sequence shards")
        return None
    if placement != Replicate():
        refuse("split across the model dim where no linear, embedding or norm reads it")
    return None


def _layout(placement) -> str:
    return "Replicate()" if placement == Replicate() else f"Shard({placement.dim})"


def _on(placements: Placements | None, dim: int):
    return None if placements is None else placements[dim]


def _output_whole(view: PlanView, dim: int) -> bool:
    """True where the model's output leaves whole on the model dim (gathered logits)."""
    first = view.outputs[0] if view.outputs else None
    return first is None or not isinstance(first[dim], Shard)


def _linear_why(placement, activation) -> str:
    if isinstance(activation, Shard) and placement == Replicate():
        return "the plan splits this linear's tokens across the model dim with the weight whole: torch's tensor-parallel styles split weights, not tokens"
    return (
        f"weight {placement_str((placement,))} with its input {placement_str((activation,))} "
        "on the model dim: no column- or row-parallel linear runs so"
    )
