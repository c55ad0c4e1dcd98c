"""Per-rank bodies of the runtime tests of its collectives (module level, so spawn can
pickle them): a plan shared by the ranks, a planned route executed step by step, gradients
reduced together and parameters gathered by layer, each against DTensor's own result."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.types.placements import placement_str
from helpers.runtime_cases import _local_rows, _plan_and_apply, build, global_batches


def plan_is_shared(rank: int, world_size: int) -> dict[str, Any]:
    """optimize_placement on real ranks: rank 0 solves, the others adopt its plan."""
    mesh = init_device_mesh("cpu", (world_size,))
    with AutoParallel(build("mlp"), lambda: torch.empty(64, 64), mesh, hardware="cpu") as autop:
        autop.add_input_constraints([(Shard(0),)])
        plan = autop.optimize_placement()
        solved_here = (
            autop.sharding_optimizer._solution is not None
        )  # only the solving rank has one
    return {
        "solved_here": solved_here,
        "placements": {k: placement_str(v) for k, v in plan.param_placements.items()},
    }


def route_is_executed(rank: int, world_size: int) -> dict[str, Any]:
    """A Partial over the inter-node dim of a (2, 2) mesh (2 ranks per node) is reduced along
    the planned route: slice over the intra-node dim, all-reduce the half-size shard across
    nodes, all-gather it back. Returns the route, the collectives issued (CommDebugMode) and
    the error against the exact sum."""
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.debug import CommDebugMode

    from autoparallel.cost import redistribution_route
    from autoparallel.cost.topology import Topology
    from autoparallel.runtime.executor import redistribute_along
    from autoparallel.types.tensors import TensorInfo

    mesh = init_device_mesh("cpu", (2, 2))
    coordinate = mesh.get_coordinate()
    torch.manual_seed(coordinate[0])  # replicated over mesh dim 1, one addend per row
    local = torch.randn(1024, 256)  # big enough for bandwidth to matter more than latency
    everyone = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    # Partial over mesh dim 0: ranks (0, c) and (1, c) hold the two addends
    exact = sum(everyone[row * 2 + coordinate[1]] for row in range(2))
    value = DTensor.from_local(local, mesh, (Partial(), Replicate()), run_check=False)
    topology = Topology((2, 2), "h100", gpus_per_node=2)
    route = redistribution_route(
        TensorInfo((1024, 256), torch.float32),
        (Partial(), Replicate()),
        (Replicate(), Replicate()),
        topology,
    )
    with CommDebugMode() as comms:
        result = redistribute_along(value, route[1:-1], (Replicate(), Replicate()))
    counts = {str(op): n for op, n in comms.get_comm_counts().items()}
    return {
        "route": [placement_str(p) for p in route],
        "comms": counts,
        "error": (result.to_local() - exact).abs().max().item(),
    }


def gradients_reduced_together(rank: int, world_size: int) -> dict[str, Any]:
    """Pending sums moved to R, S(0) and S(1) on a 1-D mesh: the coalescable ones (same
    target, even shards) share one collective, and every result equals DTensor's own
    redistribute of that tensor alone."""
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.debug import CommDebugMode

    from autoparallel.runtime.coalesce import reduce_gradients

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(rank)
    cases = [
        ((3, 5), Replicate()),
        ((7,), Replicate()),
        ((4, 6), Shard(0)),
        ((8,), Shard(0)),
        ((2, 6), Shard(1)),
        ((3, 2), Shard(0)),
    ]  # the last does not divide evenly
    values = [DTensor.from_local(torch.randn(shape), mesh, (Partial(),)) for shape, _ in cases]
    targets = [(target,) for _, target in cases]
    expected = [
        value.redistribute(mesh, target).to_local() for value, target in zip(values, targets)
    ]
    with CommDebugMode() as comms:
        coalescable = reduce_gradients(values[:4], [()] * 4, targets[:4], mesh)
    everything = reduce_gradients(values, [()] * len(values), targets, mesh)
    return {
        "comms": {str(op): count for op, count in comms.get_comm_counts().items()},
        "error": max((got - want).abs().max().item() for got, want in zip(everything, expected)),
        "coalescable_error": max(
            (got - want).abs().max().item() for got, want in zip(coalescable, expected)
        ),
        "shapes_match": all(got.shape == want.shape for got, want in zip(everything, expected)),
    }


def parameters_gathered_by_layer(rank: int, world_size: int) -> dict[str, Any]:
    """Sharded parameters read replicated: one all-gather per numbered layer, each result
    equal to the full tensor; an unevenly sharded one is left to DTensor."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from autoparallel.runtime.param_gathers import GatherPlan, ParameterGathers, plan_gather

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)  # the same full tensors on every rank
    specs = {
        "layers.0.a": ((4, 6), Shard(0)),
        "layers.0.b": ((6, 4), Shard(1)),
        "layers.1.a": ((4, 6), Shard(0)),
        "layers.1.b": ((6, 4), Shard(1)),
        "norm": ((8,), Shard(0)),
        "odd": ((3, 2), Shard(0)),
    }
    full = {name: torch.randn(shape) for name, (shape, _) in specs.items()}
    env = {
        name: distribute_tensor(full[name], mesh, (placement,))
        for name, (_, placement) in specs.items()
    }
    wanted = (Replicate(),)
    groups = {
        (name, wanted): plan_gather(name, (placement,), wanted, shape, torch.float32, (world_size,))
        for name, (shape, placement) in specs.items()
    }
    group_of = {k: g for k, g in groups.items() if g is not None}
    members: dict = {}
    for key, group in group_of.items():
        members.setdefault(group, []).append(key)
    plan = GatherPlan(
        group_of, {k: 1 for k in group_of}, members
    )  # the root group of one kept on purpose
    gathers = ParameterGathers(plan, mesh)
    with CommDebugMode() as comms:
        gathered = {name: gathers.take(name, wanted, env) for name, _ in plan.group_of}
    return {
        "groups": sorted({g.layer for g in plan.group_of.values()}),
        "uneven_planned": groups[("odd", wanted)] is not None,
        "all_gathers": sum(
            n for op, n in comms.get_comm_counts().items() if "all_gather" in str(op)
        ),
        "error": max(
            (gathered[name].to_local() - full[name]).abs().max().item() for name in gathered
        ),
        "placements": sorted({str(tuple(value.placements)) for value in gathered.values()}),
        "released": not gathers.ready,
    }


def collectives_per_call(rank: int, world_size: int) -> dict[str, Any]:
    """Collectives this rank issued in each of three training steps of a planned LLaMA
    (parameters gathered in the forward and the backward, gradients reduce-scattered) and in
    each of two inference calls, read off the process group's sequence number (one per
    collective issued); and whether every traced local graph holds fake values only."""
    from torch._subclasses.fake_tensor import FakeTensor

    mesh = init_device_mesh("cpu", (world_size,))
    _, parallel = _plan_and_apply("llama", mesh, "fsdp")
    parallel.to_empty(device="cpu")
    parallel.init_weights(seed=0)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-3, foreach=True)
    # the gloo backend's own counter: a group of a registered backend (serial_gloo) has none
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    tokens = _local_rows(global_batches("llama")[0], mesh)

    def issued(call: Any) -> int:
        before = backend._get_sequence_number_for_group()
        call()
        return backend._get_sequence_number_for_group() - before

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        parallel(tokens).float().pow(2).mean().backward()
        optimizer.step()

    def infer() -> None:
        with torch.no_grad():
            parallel(tokens)

    steps = [issued(step) for _ in range(3)]
    inference = [issued(infer) for _ in range(2)]
    runtime = parallel._autoparallel
    phases = (runtime.forward_phase, runtime.backward_phase, runtime.inference_phase)
    values = [
        node.meta.get("val")
        for phase in phases
        for node in phase.graph_module.graph.nodes
        if isinstance(node.meta.get("val"), torch.Tensor)
    ]
    return {
        "steps": steps,
        "inference": inference,
        "fake_values": bool(values) and all(isinstance(v, FakeTensor) for v in values),
    }
