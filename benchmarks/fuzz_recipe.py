"""The fuzzer's interpreter of API cases: a recipe (plain, picklable data) run on a fake mesh.

A recipe says which mesh, model and ``input_fn`` to plan with, which :class:`AutoParallel`
options to pass, which methods to call on the planner (constraints, budgets, files) and how
the case ends: ``"plan"`` (solve), ``"run"`` (solve, apply, allocate and call the parallel
module on the recipe's inputs; ``materialize: False`` calls it before ``to_empty``) or
``"auto_parallel"`` (the one-call API). Values that cannot
travel between processes as they are (tensors, DTensors, a DeviceMesh) are written as tagged
tuples and built here, in the worker that runs the case:

* ``("t", shape, dtype, device)``: a tensor of that shape (``torch.randn``, or zeros for
  integer dtypes); ``("np", shape)``: a numpy array; ``("dtensor", shape, placements)``: a
  DTensor on the case's mesh;
* ``("file", name)``: the path of a file the case prepared in its work folder.

Contract: :func:`run_recipe` returns a short description of what it ended with, or raises
whatever the library raised (the driver classifies it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autoparallel import AutoParallel, auto_parallel, fake_mesh, with_sharding_constraint
from autoparallel.models import MLP, Llama, llama_config

MLP_DIM, MLP_HIDDEN, MLP_BATCH = 32, 64, 16
"""The MLP every API case plans unless its recipe says otherwise: [16, 32] inputs."""
LLAMA_BATCH, LLAMA_SEQ = 4, 16
"""Global token ids of the tiny LLaMA cases."""


class ConstrainedMLP(nn.Module):
    """An MLP whose forward asks for its hidden activation's placements
    (``with_sharding_constraint``): the model states a constraint of its own."""

    def __init__(self, placements: Any) -> None:
        super().__init__()
        self.w1 = nn.Linear(MLP_DIM, MLP_HIDDEN)
        self.w2 = nn.Linear(MLP_HIDDEN, MLP_DIM)
        self.placements = placements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = with_sharding_constraint(torch.relu(self.w1(x)), self.placements)
        return self.w2(hidden)


def build(value: Any, mesh: Any = None, workdir: Path | None = None) -> Any:
    """A recipe value with its tagged tuples built (recursively through lists, tuples, dicts)."""
    if isinstance(value, tuple) and value and isinstance(value[0], str):
        tag = value[0]
        if tag == "t":
            _, shape, dtype, device = value
            dtype = getattr(torch, dtype)
            if dtype.is_floating_point:
                return torch.randn(shape, dtype=dtype, device=device)
            return torch.zeros(shape, dtype=dtype, device=device)
        if tag == "np":
            import numpy as np

            return np.zeros(value[1], dtype=np.float32)
        if tag == "dtensor":
            from torch.distributed.tensor import DTensor

            _, shape, placements = value
            return DTensor.from_local(torch.randn(shape), mesh, placements, run_check=False)
        if tag == "file":
            assert workdir is not None
            return str(workdir / value[1])
    if isinstance(value, list):
        return [build(v, mesh, workdir) for v in value]
    if isinstance(value, tuple):
        return tuple(build(v, mesh, workdir) for v in value)
    if isinstance(value, dict):
        return {k: build(v, mesh, workdir) for k, v in value.items()}
    return value


def make_mesh(recipe: dict[str, Any]) -> Any:
    """The mesh the recipe plans on (``mesh_arg`` replaces it with a bad value)."""
    from torch.distributed.device_mesh import DeviceMesh

    kind = recipe.get("mesh_arg")
    if kind == "outside":  # a world of 8 ranks, a mesh of ranks 4-7: this rank (0) not in it
        fake_mesh((8,))
        return DeviceMesh("cpu", [[4, 5], [6, 7]], mesh_dim_names=("dp", "tp"))
    if kind == "part":  # a world of 8 ranks, a mesh of ranks 0-3
        fake_mesh((8,))
        return DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    if kind == "fake_mesh":  # the call to fake_mesh is the case
        shape, names, rank = recipe["fake_mesh"]
        return fake_mesh(shape, names, rank)
    mesh = fake_mesh(recipe.get("mesh", (2, 2)), recipe.get("names", ("dp", "tp")))
    bad = {
        "none": None,
        "tuple": (2, 2),
        "str": "2x2",
        "group": dist.group.WORLD,
        "device": torch.device("cpu"),
        "list": [mesh],
    }
    return bad[kind] if kind in bad else mesh


def make_model(recipe: dict[str, Any]) -> Any:
    """The model on the meta device (``model`` names it; ``model_arg`` a bad value)."""
    kind = recipe.get("model", "mlp")
    with torch.device("meta"):
        if kind == "llama":
            return Llama(llama_config("tiny", n_layers=2))
        if kind == "wsc":
            return ConstrainedMLP(recipe["wsc"])
        model = MLP(MLP_DIM, MLP_HIDDEN)
    bad = {"str": "mlp", "class": MLP, "function": model.forward, "none": None}
    return bad.get(recipe.get("model_arg"), model)


def make_input_fn(recipe: dict[str, Any], mesh: Any, workdir: Path) -> Any:
    """The ``input_fn`` (``inputs``: the value it returns; ``not_callable`` passes the value)."""
    default = (
        ("t", (LLAMA_BATCH, LLAMA_SEQ), "int64", "cpu")
        if recipe.get("model") == "llama"
        else ("t", (MLP_BATCH, MLP_DIM), "float32", "cpu")
    )
    spec = recipe.get("inputs", default)
    if recipe.get("not_callable"):
        return build(spec, mesh, workdir)
    return lambda: build(spec, mesh, workdir)


def run_recipe(workdir: Path, recipe: dict[str, Any]) -> str:
    """Run one API case (see the module docstring); returns what it ended with."""
    if dist.is_initialized():
        dist.destroy_process_group()
    mesh = make_mesh(recipe)
    model = make_model(recipe)
    input_fn = make_input_fn(recipe, mesh, workdir)
    options = build(recipe.get("options", {}), mesh, workdir)
    end = recipe.get("end", "plan")
    if end == "auto_parallel":
        arguments = build(recipe.get("auto_parallel", {}), mesh, workdir)
        sample = arguments.pop("sample_inputs", input_fn)
        out = arguments.pop("out_shardings", [_batch_sharded(mesh)])
        parallel = auto_parallel(model, mesh, sample, out, **arguments, **options)
        return f"parallel module {type(parallel).__name__}"
    with AutoParallel(model, input_fn, mesh, **options) as autop:
        for target, method, args, kwargs in recipe.get("steps", ()):
            owner = autop.sharding_optimizer if target == "opt" else autop
            getattr(owner, method)(*build(args, mesh, workdir), **build(kwargs, mesh, workdir))
        plan = autop.optimize_placement()
        for method, args in recipe.get("after", ()):
            getattr(autop.sharding_optimizer, method)(*build(args, mesh, workdir))
        if end == "plan":
            return f"plan of {len(plan.param_placements)} parameters"
        parallel = autop.apply_placement(plan)
    if recipe.get("materialize", True):
        parallel.to_empty(device="cpu")
    for args, kwargs in recipe.get("calls", ()):
        parallel(*build(args, mesh, workdir), **build(kwargs, mesh, workdir))
    return f"parallel module ran {len(recipe.get('calls', ()))} call(s)"


def _batch_sharded(mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import Replicate, Shard

    ndim = getattr(mesh, "ndim", 1)
    return (Shard(0),) + (Replicate(),) * (ndim - 1)
