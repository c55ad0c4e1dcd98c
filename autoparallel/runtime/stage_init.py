"""Initializing and loading a pipeline stage with the whole model's own code and checkpoint.

A stage module is a GraphModule cut from the user's model (trace/stages.py): it holds the
model's parameters and buffers under their own names (``layers.3.attention.wq.weight``) but
none of the model's methods, so ``init_weights`` cannot run on it, and its non-persistent
buffers (a LLaMA's rotary tables) are in no state dict. The whole model (usually still on the
meta device: that is why it is planned there) has the code; this module runs that code on it
with this stage's planned tensors put in place of its own:

* every parameter and buffer of the stage replaces the whole model's tensor of that name for
  the duration of the call; the other stages' tensors stay as they are (meta: what the code
  does to them costs nothing and is dropped); afterwards the whole model holds exactly what it
  held before;
* the call runs under :func:`~autoparallel.runtime.init.full_value_init` of the stage, so every
  pattern of one-device init code gives the stage's tensors their full values (copied into
  shards, sharded random draws made full), and its non-persistent buffers are computed.

Random values: code that draws each tensor from a generator of its own, or from one it
threads through the whole model in module order on the CPU (``autoparallel.models``' init),
gives every stage exactly the one-device values. Code that draws from torch's global
generator (``nn.init.trunc_normal_(w)``) draws nothing for the other stages' meta tensors
(torch returns at once on meta, and ``trunc_normal_``'s rejection loop depends on the values
drawn), so each stage starts from the generator as it finds it: its values follow the model's
distributions but are not one device's, and stages seeded alike would draw alike. Seed each
stage apart (``torch.manual_seed(seed + pipe.pipeline.stage_index)``, as torchtitan seeds its
pipeline ranks), or load the values (``pipe.load_state_dict``, a DCP checkpoint).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch.nn as nn
from torch.distributed.tensor import DTensor

from autoparallel import _torch_internals as internals
from autoparallel.runtime.init import InitError, full_value_init


def init_stage(whole: nn.Module, stage: nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``whole.<method>(*args, **kwargs)`` (the model's ``init_weights``) so that it
    initializes ``stage``, this rank's stage's parallel module (see the module docstring)."""
    code = getattr(whole, method, None)
    if not callable(code):
        raise InitError(
            f"{type(whole).__name__} has no {method}() to initialize a pipeline stage with: "
            "define it on the model, or load the stage's values with "
            "pipe.load_state_dict(full_model_state_dict)"
        )
    _check_materialized(stage)
    with _stage_tensors_in(whole, stage), full_value_init(stage, runs_on=whole):
        return code(*args, **kwargs)


class StageKeys(NamedTuple):
    """What :meth:`ParallelPipeline.load_state_dict` found: this stage's keys the state dict
    lacked, and keys of the state dict that name no tensor of the model."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def stage_state_dict(
    whole: nn.Module, stage: nn.Module, state_dict: Mapping[str, Any], strict: bool = True
) -> tuple[dict[str, Any], StageKeys]:
    """The entries of the whole model's ``state_dict`` that belong to ``stage``, and the keys
    that did not fit; with ``strict``, any such key raises ``KeyError`` naming it. The stage's
    keys are those of the whole model's state dict it holds (the cut registers the model's
    non-persistent buffers as its own persistent ones: they are in no checkpoint)."""
    known = whole.state_dict(keep_vars=True)  # ordered: this stage's keys in model order
    held = set(stage.state_dict(keep_vars=True))
    mine = [key for key in known if key in held]
    keys = StageKeys(
        missing_keys=[key for key in mine if key not in state_dict],
        unexpected_keys=[key for key in state_dict if key not in known],
    )
    if strict and (keys.missing_keys or keys.unexpected_keys):
        parts = []
        if keys.missing_keys:
            parts.append(f"missing this stage's {_few(keys.missing_keys)}")
        if keys.unexpected_keys:
            parts.append(f"keys of no tensor of the model: {_few(keys.unexpected_keys)}")
        raise KeyError(
            f"the state dict does not fit the pipeline stage: {'; '.join(parts)} "
            "(pass strict=False to load what matches)"
        )
    return {key: state_dict[key] for key in mine if key in state_dict}, keys


def whole_model_entries(whole: nn.Module, stage_entries: dict[str, Any]) -> dict[str, Any]:
    """``stage_entries`` (a stage module's state dict) without the keys the whole model's
    state dict does not have."""
    known = set(whole.state_dict(keep_vars=True))
    return {key: value for key, value in stage_entries.items() if key in known}


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _check_materialized(stage: nn.Module) -> None:
    for name, tensor in (*stage.named_parameters(), *stage.named_buffers()):
        local = internals.local_tensor_of(tensor) if isinstance(tensor, DTensor) else tensor
        if local.is_meta:
            raise InitError(
                f"{name} of this pipeline stage is still on the meta device: call "
                "pipe.to_empty(device=...) before pipe.init_weights()"
            )


@contextlib.contextmanager
def _stage_tensors_in(whole: nn.Module, stage: nn.Module) -> Iterator[None]:
    """``whole`` holding ``stage``'s parameters and buffers under their names; every
    parameter and buffer entry of ``whole`` is put back as it was on the way out (what the
    code assigned to other stages' tensors included)."""
    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in whole.modules()]
    try:
        for kind, named in (
            ("_parameters", stage.named_parameters(remove_duplicate=False)),
            ("_buffers", stage.named_buffers(remove_duplicate=False)),
        ):
            for name, tensor in named:
                owner, leaf = _owner_of(whole, name)
                getattr(owner, kind)[leaf] = tensor
        yield
    finally:
        for module, parameters, buffers in saved:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)


def _owner_of(whole: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    try:
        owner = whole.get_submodule(path) if path else whole
    except AttributeError:
        owner = None
    if owner is None or not (leaf in owner._parameters or leaf in owner._buffers):
        raise InitError(
            f"the pipeline stage holds {name}, which the model has no tensor of: the stage was "
            "cut from another model than the one given to AutoParallel"
        )
    return owner, leaf
