"""Which layers of a model repeat, and the short models (3 and 4 layers) to trace instead.

Tracing is torch's own per-op work, paid again for every layer, so an 80-layer model
would spend most of its planning time there. When a model's layers are
identical modules we trace it twice with only its first 3 and first 4 layers and build the
N-layer graph from those (``layer_stamping.py``; ``export.py`` runs both).

:func:`find_repeated_layers` finds the outermost ``ModuleList``/``ModuleDict`` whose children
are the same class with the same parameter and buffer shapes, equal plain settings and the
same hooks (none, or one function with equal settings on every layer), so that nothing
visible tells one layer from another. Integer attributes that number
the layers (Hugging Face's ``layer_idx``) may differ: :func:`with_first_layers` replaces them
in the short models by :class:`UnreadLayerIndex`, so a forward that reads them fails there
and the model is traced whole.

What this cannot catch is a forward that treats layers by their position in a way the first
four do not show (``if i == 57``); ``AutoParallel(..., trace_layers_once=False)`` traces every
layer.
"""

from __future__ import annotations

import functools
import logging
import re
import types
from typing import Any

import torch
import torch.nn as nn

from autoparallel.types.graph import RepeatedLayers

logger = logging.getLogger(__name__)

# Below this depth a full trace costs about what the two short traces do.
MIN_LAYERS = 6

_MODULE_INTERNALS = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
)
_HOOK_DICT = re.compile(r"^_(global_)?(forward|backward|state_dict|load_state_dict).*hooks.*$")


# ---------------------------------------------------------------------------- finding layers


def find_repeated_layers(model: nn.Module, min_layers: int = MIN_LAYERS) -> RepeatedLayers | None:
    """The outermost container of at least ``min_layers`` interchangeable layers, if any.

    Containers inside another stack of same-class layers (the experts of each MoE layer)
    are not considered: repeating the outer stack is what saves the trace. Among several
    outer stacks the longest wins. A stack whose layers are not interchangeable is logged
    with the first difference found, since it means every layer is traced.
    """
    shared = _shared_parameter_ids(model)
    stacks: list[str] = []
    best: RepeatedLayers | None = None
    for path, container in model.named_modules():
        if (
            not path
            or not isinstance(container, (nn.ModuleList, nn.ModuleDict))
            or len(container) < min_layers
        ):
            continue
        children = list(container._modules.items())
        if (
            any(child is None for _, child in children)
            or len({type(child) for _, child in children}) > 1
        ):
            continue
        if any(path.startswith(outer + ".") for outer in stacks):
            continue
        stacks.append(path)
        reason, index_attributes = _why_not_repeated(container, children, shared)
        if reason is not None:
            logger.info(
                "the %d layers of `%s` are traced one by one: %s", len(children), path, reason
            )
            continue
        if best is None or len(children) > best.count:
            best = RepeatedLayers(
                path, tuple(key for key, _ in children), tuple(sorted(index_attributes))
            )
    return best


def _why_not_repeated(
    container: nn.Module, children: list[tuple[str, nn.Module]], shared: set[int]
) -> tuple[str | None, set[str]]:
    """(why the children are not interchangeable or None, their integer index attributes)."""
    if _has_hooks(container):
        return "the container has hooks", set()
    first_key, first = children[0]
    index_attributes: set[str] = set()
    for key, child in children[1:]:
        difference = _difference(first, child, index_attributes)
        if difference is not None:
            return f"layer {key} differs from layer {first_key}: {difference}", set()
    for key, child in children:
        if any(id(param) in shared for param in child.parameters()):
            return f"layer {key} shares a parameter with another module", set()
    return None, index_attributes


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    """Parameters reachable under more than one name (tied): a copy could not own them."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _has_hooks(module: nn.Module) -> bool:
    return any(hooks for _, hooks in _hooks(module))


def _difference(
    a: nn.Module, b: nn.Module, index_attributes: set[str], depth: int = 0
) -> str | None:
    """The first thing that tells layer ``b`` from layer ``a`` (None if nothing does).

    Integer attributes that differ are not a difference: they are added to
    ``index_attributes`` (dotted paths inside the layer).
    """
    modules_a, modules_b = list(a.named_modules()), list(b.named_modules())
    if [name for name, _ in modules_a] != [name for name, _ in modules_b]:
        return "different submodules"
    for (name, x), (_, y) in zip(modules_a, modules_b):
        where = name or "the layer"
        if type(x) is not type(y):
            return f"{where} is a {type(x).__name__} in one and a {type(y).__name__} in the other"
        if not _same_hooks(x, y, depth):
            return f"{where} has hooks that differ between the layers"
        if _tensor_layout(x._parameters) != _tensor_layout(y._parameters):
            return f"{where} has other parameter shapes, dtypes or requires_grad"
        if _tensor_layout(x._buffers) != _tensor_layout(y._buffers) or (
            x._non_persistent_buffers_set != y._non_persistent_buffers_set
        ):
            return f"{where} has other buffers"
        state_x, state_y = _plain_state(x), _plain_state(y)
        for key in sorted(state_x.keys() | state_y.keys()):
            path = f"{name}.{key}" if name else key
            if key not in state_x or key not in state_y:
                return f"`{path}` is set in one layer only"
            value_x, value_y = state_x[key], state_y[key]
            if _same_value(value_x, value_y, depth):
                continue
            if type(value_x) is int and type(value_y) is int:
                index_attributes.add(path)
                continue
            return f"`{path}` differs"
    return None


def _hooks(module: nn.Module) -> list[tuple[str, list[Any]]]:
    """Each hook dict of ``module`` (by name) with its hooks in order, handles left out."""
    return [
        (key, list(value.values()))
        for key, value in sorted(vars(module).items())
        if _HOOK_DICT.match(key) and isinstance(value, dict)
    ]


def _same_hooks(a: nn.Module, b: nn.Module, depth: int = 0) -> bool:
    """The same hooks in the same order: the same function with equal settings, as a library
    installs on every layer (Hugging Face's output-capturing hooks, once a forward asked for
    hidden states). Such hooks run in the short traces as in the full one."""
    hooks_a, hooks_b = _hooks(a), _hooks(b)
    if [(key, len(fns)) for key, fns in hooks_a] != [(key, len(fns)) for key, fns in hooks_b]:
        return False
    return all(
        _same_value(f, g, depth)
        for (_, fns_a), (_, fns_b) in zip(hooks_a, hooks_b)
        for f, g in zip(fns_a, fns_b)
    )


def _plain_state(module: nn.Module) -> dict[str, Any]:
    return {
        k: v
        for k, v in vars(module).items()
        if k not in _MODULE_INTERNALS and not _HOOK_DICT.match(k)
    }


def _tensor_layout(tensors: dict[str, Any]) -> list[tuple]:
    return [
        (name, None) if t is None else (name, tuple(t.shape), t.dtype, t.requires_grad)
        for name, t in tensors.items()
    ]


_CLOSURE_DEPTH = 4
"""How deep values are compared through the modules and functions they hold (a hook that
closes over its own layer leads back to it)."""


def _same_value(a: Any, b: Any, depth: int = 0) -> bool:
    """Equal plain settings, modules that nothing tells apart, or functions made from the
    same code over equal values; anything richer must be the very same object."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return a == b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], depth) for k in a)
    if isinstance(a, functools.partial):  # e.g. an activation made per layer: partial(gelu, ...)
        return (
            a.func is b.func
            and _same_value(a.args, b.args, depth)
            and _same_value(a.keywords, b.keywords, depth)
        )
    if isinstance(a, nn.Module):  # a helper module kept outside `_modules`, e.g. HF's hub kernels
        numbered: set[str] = set()
        if depth >= _CLOSURE_DEPTH:  # reached again through what it holds (a hook over `self`)
            return False
        return _difference(a, b, numbered, depth + 1) is None and not numbered
    if isinstance(a, types.FunctionType):  # a hook or helper defined once per layer
        return depth < _CLOSURE_DEPTH and _same_function(a, b, depth + 1)
    return False


def _same_function(a: types.FunctionType, b: types.FunctionType, depth: int) -> bool:
    if a.__code__ is not b.__code__ or a.__globals__ is not b.__globals__:
        return False
    cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
    return (
        _same_value(a.__defaults__, b.__defaults__, depth)
        and _same_value(a.__kwdefaults__, b.__kwdefaults__, depth)
        and len(cells_a) == len(cells_b)
        and all(
            _same_value(x.cell_contents, y.cell_contents, depth) for x, y in zip(cells_a, cells_b)
        )
    )


class LayerIndexRead(RuntimeError):
    """The model's forward read a layer-numbering attribute while being traced."""


class UnreadLayerIndex:
    """Stands in for a layer's index attribute in the short traces: any use of its value
    (comparison, arithmetic, hashing, indexing, formatting) raises :class:`LayerIndexRead`."""

    def __init__(self, attribute: str) -> None:
        object.__setattr__(self, "attribute", attribute)

    def _read(self, *args: Any, **kwargs: Any) -> Any:
        raise LayerIndexRead(f"the forward reads the layer index `{self.attribute}`")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = __bool__ = _read
    __int__ = __index__ = __float__ = __str__ = __format__ = __neg__ = __abs__ = _read
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _read
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __pow__ = __rpow__ = _read

    def __repr__(self) -> str:
        return f"<layer index {self.attribute}, not to be read while tracing>"

    def __copy__(self) -> UnreadLayerIndex:
        return self

    def __deepcopy__(self, memo: dict) -> UnreadLayerIndex:
        return self


def with_first_layers(model: nn.Module, layers: RepeatedLayers, count: int) -> nn.Module:
    """A shallow copy of ``model`` whose container holds only its first ``count`` layers,
    their index attributes replaced by :class:`UnreadLayerIndex`.

    Only the modules on the way to what changes are copied; the user's model is untouched.
    """
    container = model.get_submodule(layers.path)
    kept = [
        (key, _without_index(container._modules[key], layers.index_attributes))
        for key in layers.keys[:count]
    ]
    short = (
        nn.ModuleDict(kept)
        if isinstance(container, nn.ModuleDict)
        else nn.ModuleList(m for _, m in kept)
    )
    return _replace_submodule(model, layers.path.split("."), short)


def _without_index(layer: nn.Module, index_attributes: tuple[str, ...]) -> nn.Module:
    for attribute in index_attributes:
        *module_path, name = attribute.split(".")
        owner = _shallow_copy(layer.get_submodule(".".join(module_path)))
        object.__setattr__(owner, name, UnreadLayerIndex(attribute))
        layer = _replace_submodule(layer, module_path, owner)
    return layer


def _shallow_copy(module: nn.Module) -> nn.Module:
    copied = object.__new__(type(module))
    copied.__dict__.update(module.__dict__)
    copied._modules = dict(module._modules)
    return copied


def _replace_submodule(module: nn.Module, path: list[str], new: nn.Module) -> nn.Module:
    if not path:
        return new
    head, *rest = path
    copied = _shallow_copy(module)
    copied._modules[head] = _replace_submodule(module._modules[head], rest, new)
    return copied
