"""A :class:`TorchRecipe` written as a Python file a user reads, reviews and commits.

The file holds one function, ``parallelize(model, mesh, mp_policy=None)``, that uses torch
only (``parallelize_module``, ``fully_shard``, ``checkpoint_wrapper``, DDP) in the order
torchtitan's recipes apply them: tensor parallelism, then recomputation, then FSDP2 (which
must wrap the other two). Each decision carries a comment with the plan's reason. Numbered
layers that get the same styles are written once, as a loop.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from autoparallel.export.recipe import ModuleStyle, ShardedUnit, TorchRecipe, Unexpressed

_STYLE_CLASS = {
    "colwise": "ColwiseParallel",
    "rowwise": "RowwiseParallel",
    "sequence": "SequenceParallel",
    "gather_input": "PrepareModuleInput",
}


@dataclass(frozen=True)
class TorchCode:
    """The exported source, the recipe it writes, and the plan's choices it could not."""

    source: str
    recipe: TorchRecipe

    @property
    def unexpressed(self) -> tuple[Unexpressed, ...]:
        return self.recipe.unexpressed


def render(recipe: TorchRecipe) -> str:
    """The Python source of ``parallelize`` for ``recipe``."""
    lines = _header(recipe)
    lines += [
        "",
        "",
        "def parallelize(",
        "    model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None",
        ") -> nn.Module:",
        f'    """Parallelize ``model`` in place on ``mesh`` (shape {recipe.mesh_shape}, dims '
        f'{recipe.mesh_dim_names}); returns the module to train."""',
    ]
    lines += _tensor_parallel(recipe)
    lines += _checkpointing(recipe)
    lines += _data_parallel(recipe)
    lines.append("    return model")
    return "\n".join(lines) + "\n"


def _mesh_of(recipe: TorchRecipe, name: str) -> str:
    return "mesh" if len(recipe.mesh_shape) == 1 else f'mesh["{name}"]'


def _header(recipe: TorchRecipe) -> list[str]:
    step = "" if recipe.step_us is None else f", predicted step {recipe.step_us / 1000:.3f} ms"
    doc = [
        '"""Written by `autoparallel export` from a plan: torch\'s own APIs only.',
        "",
        f"Mesh {recipe.mesh_shape} {recipe.mesh_dim_names}, priced on {recipe.priced_on or '?'}{step}.",
    ]
    if recipe.loss_parallel:
        doc += [
            "The head leaves its logits split on the model dim: compute the loss under",
            "``torch.distributed.tensor.parallel.loss_parallel()``.",
        ]
    if recipe.unexpressed:
        doc += ["", "Choices of the plan torch's styles do not express (left as torch does them):"]
        doc += [f"- {u.name}: {u.chosen}; {u.why}" for u in recipe.unexpressed]
    imports = [
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import torch",
        "import torch.nn as nn",
        "from torch.distributed.device_mesh import DeviceMesh",
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
        "from torch.distributed.tensor import Replicate, Shard",
    ]
    classes = sorted({_STYLE_CLASS[s.style] for s in recipe.styles})
    if classes:
        imports.append(
            "from torch.distributed.tensor.parallel import "
            + ", ".join(classes + ["parallelize_module"])
        )
    if recipe.checkpointed:
        imports.append(
            "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import "
            "checkpoint_wrapper"
        )
    if recipe.data_parallel == "replicate":
        imports.append("from torch.nn.parallel import DistributedDataParallel")
    imports.append("")
    imports.append(f"LOSS_PARALLEL = {recipe.loss_parallel}")
    if any(unit.shard_dims for unit in recipe.units):
        imports += _SHARD_DIMS_HELPER
    return doc + imports


_SHARD_DIMS_HELPER = [
    "",
    "",
    "def _shard_dims(module: nn.Module, dims: dict[str, int]):",
    '    """FSDP2\'s ``shard_placement_fn``: the named parameters of ``module`` sharded on the',
    '    given dim (the others on dim 0)."""',
    "    chosen = {module.get_parameter(name): Shard(dim) for name, dim in dims.items()}",
    "    return lambda param: chosen.get(param)",
]


# ---------------------------------------------------------------------------- tensor parallel


def _style_call(style: ModuleStyle) -> str:
    if style.style == "gather_input":
        return (
            f"PrepareModuleInput(input_layouts=({style.input_layouts},), "
            "desired_input_layouts=(Replicate(),), use_local_output=True)"
        )
    arguments = []
    if style.input_layouts is not None:
        arguments.append(f"input_layouts={style.input_layouts}")
    if style.output_layouts is not None:
        arguments.append(f"output_layouts={style.output_layouts}")
    if not style.use_local_output:
        arguments.append("use_local_output=False")
    return f"{_STYLE_CLASS[style.style]}({', '.join(arguments)})"


def _layer_groups(styles: tuple[ModuleStyle, ...]):
    """(container, {index: {relative path: style}}) of numbered layers, and the rest."""
    layers: dict[str, dict[str, dict[str, ModuleStyle]]] = defaultdict(lambda: defaultdict(dict))
    rest: list[ModuleStyle] = []
    for style in styles:
        parts = style.module.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if index is None or index == len(parts) - 1:
            rest.append(style)
            continue
        container, number = ".".join(parts[:index]), parts[index]
        layers[container][number][".".join(parts[index + 1 :])] = style
    return layers, rest


def _plan_entries(styles: dict[str, ModuleStyle], indent: str) -> list[str]:
    lines = []
    for path, style in styles.items():
        lines.append(f"{indent}# {style.why}")
        lines.append(f'{indent}"{path}": {_style_call(style)},')
    return lines


def _tensor_parallel(recipe: TorchRecipe) -> list[str]:
    if not recipe.styles or recipe.model_dim is None:
        return []
    lines = ["", f"    # tensor parallelism on {recipe.model_dim!r}"]
    lines.append(f"    tp = {_mesh_of(recipe, recipe.model_dim)}")
    layers, rest = _layer_groups(recipe.styles)
    if rest:
        lines.append("    parallelize_module(model, tp, {")
        lines += _plan_entries({s.module: s for s in rest}, "        ")
        lines.append("    })")
    for container, numbered in layers.items():
        shapes = {
            tuple((p, _style_call(s)) for p, s in entries.items()) for entries in numbered.values()
        }
        if len(shapes) == 1:
            indexes = sorted(int(n) for n in numbered)
            first = numbered[str(indexes[0])]
            lines.append(
                f"    # the same styles in every one of layers {_ranges(indexes)} of {container}"
            )
            lines.append(f"    for index in {_index_expr(indexes)}:")
            lines.append(
                f'        parallelize_module(model.get_submodule(f"{container}.{{index}}"), tp, {{'
            )
            lines += _plan_entries(first, "            ")
            lines.append("        })")
            continue
        for number, entries in sorted(numbered.items(), key=lambda item: int(item[0])):
            lines.append(
                f'    parallelize_module(model.get_submodule("{container}.{number}"), tp, {{'
            )
            lines += _plan_entries(entries, "        ")
            lines.append("    })")
    return lines


def _ranges(indexes: list[int]) -> str:
    return (
        f"{indexes[0]}..{indexes[-1]}"
        if indexes == list(range(indexes[0], indexes[-1] + 1))
        else str(indexes)
    )


def _index_expr(indexes: list[int]) -> str:
    if indexes == list(range(indexes[0], indexes[-1] + 1)):
        return f"range({indexes[0]}, {indexes[-1] + 1})"
    return str(tuple(indexes))


# ---------------------------------------------------------------------------- recomputation


def _checkpointing(recipe: TorchRecipe) -> list[str]:
    if not recipe.checkpointed:
        return []
    return [
        "",
        "    # recomputed in the backward: the plan keeps no activation of these layers",
        f"    for name in {recipe.checkpointed!r}:",
        '        parent, _, child = name.rpartition(".")',
        "        owner = model.get_submodule(parent)",
        "        owner.register_module(child, checkpoint_wrapper(owner.get_submodule(child)))",
    ]


# ---------------------------------------------------------------------------- data parallel


def _data_parallel(recipe: TorchRecipe) -> list[str]:
    if recipe.data_parallel == "none" or recipe.data_dim is None:
        return []
    mesh = _mesh_of(recipe, recipe.data_dim)
    if recipe.data_parallel == "replicate":
        return [
            "",
            f"    # every parameter whole on {recipe.data_dim!r}: gradients all-reduced (DDP)",
            f"    model = DistributedDataParallel(model, process_group={mesh}.get_group())",
        ]
    lines = [
        "",
        f"    # parameters sharded on {recipe.data_dim!r} and gathered for each layer's compute (FSDP2)",
        f"    dp = {mesh}",
        f"    policy = mp_policy or {_policy(recipe)}  # the policy the plan was made under",
    ]
    groups: dict[tuple, list[ShardedUnit]] = {}
    for unit in recipe.units:
        if unit.module:  # layers that shard alike are written as one loop
            key = (tuple(sorted(_relative_dims(unit).items())), unit.reshard_after_forward)
            groups.setdefault(key, []).append(unit)
    for units in groups.values():
        if len(units) == 1:
            lines.append(_fully_shard(units[0], f'model.get_submodule("{units[0].module}")'))
            continue
        lines.append(f"    for name in {tuple(u.module for u in units)!r}:")
        lines.append(_fully_shard(units[0], "model.get_submodule(name)", indent="        "))
    root = next(u for u in recipe.units if not u.module)
    lines.append(_fully_shard(root, "model"))
    return lines


def _policy(recipe: TorchRecipe) -> str:
    """The plan's mixed-precision policy as torch code (FSDP2's default where none)."""
    dtypes = [
        f"{field}=torch.{dtype}"
        for field, dtype in (
            ("param_dtype", recipe.param_dtype),
            ("reduce_dtype", recipe.reduce_dtype),
        )
        if dtype is not None
    ]
    return f"MixedPrecisionPolicy({', '.join(dtypes)})"


def _relative_dims(unit: ShardedUnit) -> dict[str, int]:
    """The unit's parameters sharded on a dim other than 0, named within the unit."""
    prefix = f"{unit.module}." if unit.module else ""
    return {name.removeprefix(prefix): dim for name, dim in unit.shard_dims.items()}


def _fully_shard(unit: ShardedUnit, module: str, indent: str = "    ") -> str:
    """One ``fully_shard`` call of ``module`` (source text) as ``unit`` says."""
    keep = "" if unit.reshard_after_forward else ", reshard_after_forward=False"
    dims = _relative_dims(unit)
    if not dims:
        return f"{indent}fully_shard({module}, mesh=dp, mp_policy=policy{keep})"
    return (
        f"{indent}# sharded on another dim than 0: "
        f"{', '.join(f'{n} on {d}' for n, d in dims.items())}\n"
        f"{indent}fully_shard({module}, mesh=dp, mp_policy=policy{keep}, "
        f"shard_placement_fn=_shard_dims({module}, {dims!r}))"
    )
