"""The Plan: what the solver chose, in plain data keyed by node and parameter names.

Every reader of a solution (the log, later explain/diff/save/load and the runtime) reads this
one type. It holds names and placements, never live torch objects, so it can be kept and
compared.
"""

from __future__ import annotations

import torch.fx as fx

from autoparallel.cost.regions import region_cost_parts_us
from autoparallel.cost.topology import Topology
from autoparallel.problem.memory import estimate_memory, memory_model
from autoparallel.problem.overlap import window_times
from autoparallel.problem.recompute import recompute_counts
from autoparallel.regions.local_map import region_backward_op
from autoparallel.solver.parameter_uses import parameter_uses
from autoparallel.types.costs import EdgeCost
from autoparallel.types.placements import OutputPlacements, Placements
from autoparallel.types.plan import (
    ArgumentCost,
    BucketCost,
    CostTotals,
    NodePlan,
    OverlapCost,
    Plan,
    Solution,
)
from autoparallel.types.problem import Problem


def _pair_price(edge: EdgeCost, src_index: int, dst_index: int) -> tuple[float, float]:
    """(comm, transition) of one pair: straight from the route table when the edge has one
    (the numbers its pair table was filled with), else by scanning its (small) pair list."""
    if edge.routes is not None:
        return edge.routes.table.price(
            edge.routes.src_states[src_index], edge.routes.dst_states[dst_index]
        )
    return next(
        ((c, t) for i, j, c, t in edge.pairs if i == src_index and j == dst_index),
        (float("nan"), 0.0),
    )


def _route(
    edge: EdgeCost, src: OutputPlacements, dst: OutputPlacements
) -> tuple[OutputPlacements, ...]:
    """Intermediate placements of the priced route (none for direct-model edges)."""
    if edge.routes is None or src == dst:
        return ()
    return tuple(edge.routes.pricer.route(src, dst)[1:-1])


def _region_collectives_us(node: fx.Node, strategy: int, topology: Topology) -> float:
    """The collectives a ``local_map`` region's op issues itself in the layout of its
    strategy ``strategy`` (strategies/regions.py), which its priced compute includes
    (cost/regions.py); 0 for any other node."""
    region = node.meta.get("local_map_region")
    if region is None:
        return 0.0
    layout = region.layouts[strategy]
    _, collectives = region_cost_parts_us(layout, node.target is region_backward_op, topology)
    return collectives


def build_plan(
    problem: Problem, solution: Solution, mesh_dim_names: tuple[str, ...] | None
) -> Plan:
    joint, space, tables = problem.joint, problem.space, problem.tables
    choice = solution.choice
    nodes: dict[str, NodePlan] = {}
    for node, ns in space.nodes.items():
        value = node.meta.get("val")
        phase = (
            "placeholder"
            if node.op == "placeholder"
            else ("forward" if node in joint.forward_nodes else "backward")
        )
        priced_us = tables.compute_us[node][choice[node]]
        collectives = _region_collectives_us(node, choice[node], tables.topology)
        nodes[node.name] = NodePlan(
            name=node.name,
            target=str(node.target) if node.op != "placeholder" else joint.placeholder_role(node),
            shape=tuple(value.shape) if hasattr(value, "shape") else None,
            phase=phase,
            strategy=ns.strategies[choice[node]],
            compute_us=priced_us - collectives,
            collectives_us=collectives,
        )
    bucket_of = {(m.edge, m.pair): (b, m) for b in problem.buckets for m in b.members}
    bucket_edges = {edge for edge, _ in bucket_of}  # the pair is looked up on these only
    in_use: dict[int, int] = {}  # id(bucket) -> tensors in it
    for index, edge in enumerate(tables.edges):
        src_index = edge.src_of_strategy[choice[edge.producer]]
        dst_index = edge.dst_of_strategy[choice[edge.consumer]]
        comm, transition = _pair_price(edge, src_index, dst_index)
        src, dst = edge.src_options[src_index], edge.dst_options[dst_index]
        route = _route(edge, src, dst)
        found = (
            bucket_of.get((index, problem.pair_index(index, src_index, dst_index)))
            if index in bucket_edges
            else None
        )
        if found is not None:  # one step, coalesced: its latency is paid by the bucket
            bucket, member = found
            comm, route = comm - member.saving_us, ()
            in_use[id(bucket)] = in_use.get(id(bucket), 0) + 1
        nodes[edge.consumer.name].arguments.append(
            ArgumentCost(
                producer=edge.producer.name,
                slot=edge.slot,
                kind=edge.kind,
                src=src,
                dst=dst,
                comm_us=comm,
                transition_us=transition,
                route=route,
            )
        )
    buckets = [
        BucketCost(
            b.kind,
            b.description,
            b.latency_us,
            in_use[id(b)],
            b.candidates,
            "forward"
            if problem.tables.edges[b.members[0].edge].consumer in joint.forward_nodes
            else "backward",
        )
        for b in problem.buckets
        if id(b) in in_use
    ]

    def placement_of(node) -> Placements:
        return nodes[node.name].strategy.output

    output_placements: list[Placements | None] = []
    for index, output in enumerate(joint.user_outputs):
        tangent = joint.tangents.get(index)
        source = tangent if tangent is not None else output
        output_placements.append(placement_of(source) if source is not None else None)

    counts = recompute_counts(memory_model(problem).recompute, solution.auxiliary)
    memory = estimate_memory(problem, choice, problem.memory_budget, counts)
    optimizer = sum(n.compute_us for n in nodes.values() if n.phase == "placeholder")
    if joint.param_grads:  # once per step, colder the more memory the step touches
        optimizer += tables.topology.hardware.optimizer_fixed_us(memory.peak)
    runtime = tables.topology.hardware.runtime_us(len(joint.param_grads))
    compute = sum(n.compute_us for n in nodes.values() if n.phase != "placeholder")
    compute += optimizer + runtime
    compute += memory.recompute_us  # the recomputed layers' forward, again in the backward
    comm = sum(n.comm_us for n in nodes.values()) + sum(b.latency_us for b in buckets)
    transition = sum(n.transition_us for n in nodes.values())
    overlaps = _overlaps(problem, choice)
    hidden = sum(o.hidden_us for o in overlaps)
    return Plan(
        mesh_shape=space.mesh_shape,
        mesh_dim_names=mesh_dim_names,
        nodes=nodes,
        param_placements={name: placement_of(node) for name, node in joint.params.items()},
        buffer_placements={name: placement_of(node) for name, node in joint.buffers.items()},
        input_placements=[placement_of(node) for node in joint.user_inputs],
        output_placements=output_placements,
        totals=CostTotals(
            compute + comm + transition - hidden,
            comm,
            compute,
            transition,
            optimizer,
            hidden,
            runtime,
            runtime * tables.topology.hardware.runtime_forward_share,
        ),
        solver=solution.stats,
        fallbacks=list(space.fallbacks),
        buckets=buckets,
        overlaps=overlaps,
        priced_on=tables.topology.hardware.name,
        memory=memory,
        recompute=memory.recomputed,
        parameter_uses=parameter_uses(joint, nodes),
    )


def _overlaps(problem: Problem, choice: dict) -> list[OverlapCost]:
    """Each overlap window's compute, overlappable comm and hidden part for the chosen
    strategies: the hardware's fraction of the smaller of the two (problem/overlap.py)."""
    found = []
    for window in problem.overlap_windows:
        compute, comm = window_times(problem, window, choice)
        if comm <= 0.0:
            continue
        hidden = problem.overlap_fraction * min(compute, comm)
        found.append(OverlapCost(window.phase, window.comm, window.during, comm, compute, hidden))
    return found
