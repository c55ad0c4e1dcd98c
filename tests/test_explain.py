"""Explaining and comparing plans: explain_placement, cost matrices, diffs, the prefetch
discount and the JSON view (all on the fake process group, planning only)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import meta
from helpers.planning import Partial, Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.explain import CHOSEN, CHOSEN_CHEAPER, TARGET_CHEAPER, TIE, UNAVAILABLE
from autoparallel.files.plan_json_graph import (
    collective_kind,
    module_of_parameter,
    owner_of_parameter,
)
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.types.placements import placement_str

BATCH_SHARDED = [(Shard(0),)]


@contextmanager
def solved_mlp(mesh, memory: bool = True) -> Iterator[AutoParallel]:
    """AutoParallel for the MLP of test_plan_mlp (batch-sharded in and out), solved once:
    FSDP-like with the memory constraint, DDP-like without."""
    with AutoParallel(
        meta(lambda: MLP(1024, 4096)), lambda: torch.randn(8192, 1024), mesh
    ) as autop:
        autop.add_input_constraints(BATCH_SHARDED)
        autop.add_output_constraints(BATCH_SHARDED)
        if memory:
            autop.add_parameter_memory_constraint()
        autop.optimize_placement()
        yield autop


def param_node_name(autop: AutoParallel, fqn: str) -> str:
    return autop.sharding_optimizer.problem.joint.params[fqn].name


# ---------------------------------------------------------------------------- explain_placement


def test_explain_placement_statuses_on_fsdp_mlp(fake_mesh, caplog):
    with solved_mlp(fake_mesh((4,))) as autop:
        optimizer = autop.sharding_optimizer
        plan = optimizer.get_solution()
        with caplog.at_level(logging.INFO, logger="autoparallel.explain"):
            rows = optimizer.explain_placement((Shard(0),))
        assert len(rows) == len(plan.nodes)
        by_name = {row.node: row for row in rows}
        for row in rows:
            assert row.chosen == plan.nodes[row.node].strategy.output
            if row.chosen == (Shard(0),):
                assert row.status == CHOSEN
                assert row.target_us == pytest.approx(row.chosen_us)
            elif row.status == UNAVAILABLE:
                assert math.isinf(row.target_us)
            elif row.status == TIE:
                assert row.target_us == pytest.approx(row.chosen_us, rel=1e-6)
            else:
                assert row.status == (
                    CHOSEN_CHEAPER if row.chosen_us < row.target_us else TARGET_CHEAPER
                )
        # FSDP: every parameter is sharded (which dim is a tie the solver breaks); those on
        # S(0) are CHOSEN, the others cost no less than S(0) locally
        for fqn in ("w1.weight", "w1.bias", "w2.weight", "w2.bias"):
            row = by_name[param_node_name(autop, fqn)]
            assert isinstance(row.chosen[0], Shard)
            assert (
                row.status == CHOSEN
                if row.chosen == (Shard(0),)
                else row.status in (TIE, CHOSEN_CHEAPER)
            )
        assert by_name[param_node_name(autop, "w1.bias")].status == CHOSEN
        statuses = {row.status for row in rows}
        assert CHOSEN_CHEAPER in statuses
        # the transpose feeding the forward matmul is gathered to R; S(0) would be cheaper for
        # it alone (an all-to-all instead of an all-gather) but not for the matmul that follows
        assert TARGET_CHEAPER in statuses
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "status (target S(0))" in text and "compute us" in text and "comm us" in text
        assert CHOSEN in text


def test_explain_placement_unavailable_and_selected_nodes(fake_mesh):
    with solved_mlp(fake_mesh((4,))) as autop:
        optimizer = autop.sharding_optimizer
        bias = param_node_name(autop, "w1.bias")  # a 1-D vector: it has no dim 1 to shard
        weight = optimizer.problem.joint.params["w1.weight"]  # an fx.Node works too
        rows = optimizer.explain_placement((Shard(1),), nodes=[bias, weight])
        assert [row.node for row in rows] == [bias, weight.name]
        assert rows[0].status == UNAVAILABLE and rows[0].shape == (4096,)
        # a placeholder has no compute: only its gradient's redistribution differs, and the
        # plan's choice is never locally worse than S(1) (at best a tie)
        assert rows[1].status in (CHOSEN, TIE, CHOSEN_CHEAPER)
        assert (rows[1].status == CHOSEN) == (rows[1].chosen == (Shard(1),))
        assert rows[1].chosen_compute_us == rows[1].target_compute_us == 0.0
        assert rows[1].target_us >= rows[1].chosen_us * (1 - 1e-6)


def test_explain_placement_needs_a_solution(fake_mesh):
    with AutoParallel(
        meta(lambda: MLP(16, 64)), lambda: torch.randn(8, 16), fake_mesh((2,))
    ) as autop:
        with pytest.raises(RuntimeError, match="no solution yet"):
            autop.sharding_optimizer.explain_placement((Replicate(),))
        with pytest.raises(RuntimeError, match="no solution yet"):
            autop.sharding_optimizer.get_json()


# ---------------------------------------------------------------------------- cost matrix


def _parse_matrix(text: str) -> tuple[list[str], list[str], list[list[str]]]:
    lines = text.splitlines()
    columns = lines[1].split()
    rows, cells = [], []
    for line in lines[2:]:
        first, *rest = line.split()
        rows.append(first)
        cells.append(rest)
    return columns, rows, cells


def test_print_costs_for_node_marks_the_chosen_pair(fake_mesh, caplog):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with AutoParallel(meta(lambda: MLP(16, 64)), lambda: torch.randn(8, 16), mesh) as autop:
        autop.add_input_constraints([(Shard(0), Replicate())])
        plan = autop.optimize_placement()
        optimizer = autop.sharding_optimizer
        addmm = next(
            n for n in optimizer.problem.space.nodes if n.target == torch.ops.aten.addmm.default
        )
        edge = next(
            e for e in optimizer.problem.tables.incoming[addmm] if e.kind == "arg" and e.slot == 1
        )
        with caplog.at_level(logging.INFO, logger="autoparallel.explain"):
            text = optimizer.print_costs_for_node(addmm.name, arg=1)
        assert optimizer.print_costs_for_node(addmm, 1) == text
    assert "comm us" in text and f"{edge.producer.name} -> {addmm.name} (arg 1)" in text
    assert text in "\n".join(r.getMessage() for r in caplog.records)
    columns, rows, cells = _parse_matrix(text)
    assert len(rows) == len(edge.src_options) and len(columns) == len(edge.dst_options)
    assert all(len(line) == len(columns) for line in cells)
    assert "S(0)R" in rows
    # identity redistributions are free
    for r, src in enumerate(rows):
        if src in columns:
            assert cells[r][columns.index(src)].rstrip("*") == "0.00"
    # exactly one chosen pair, and it is the plan's
    starred = [
        (rows[r], columns[c])
        for r, line in enumerate(cells)
        for c, cell in enumerate(line)
        if cell.endswith("*")
    ]
    argument = next(a for a in plan.nodes[addmm.name].arguments if a.kind == "arg" and a.slot == 1)
    assert starred == [(placement_str(argument.src), placement_str(argument.dst))]
    assert all(cell == "inf" or float(cell.rstrip("*")) >= 0 for line in cells for cell in line)


def test_print_costs_for_node_rejects_a_missing_argument(fake_mesh):
    with solved_mlp(fake_mesh((2,)), memory=False) as autop:
        with pytest.raises(KeyError, match="has no arg input 7"):
            autop.sharding_optimizer.print_costs_for_node("addmm", arg=7)
        with pytest.raises(KeyError, match="no node named"):
            autop.sharding_optimizer.print_costs_for_node("not_a_node")


# ---------------------------------------------------------------------------- diff


def test_diff_between_ddp_and_fsdp(fake_mesh):
    with solved_mlp(fake_mesh((4,)), memory=False) as autop:
        optimizer = autop.sharding_optimizer
        ddp = optimizer.get_solution()
        autop.add_parameter_memory_constraint()
        fsdp = optimizer.resolve()
        diff = optimizer.diff_solutions(ddp, fsdp)
        assert {p.name for p in diff.parameters} == {"w1.weight", "w1.bias", "w2.weight", "w2.bias"}
        assert all(p.before == "R" and p.after.startswith("S(") for p in diff.parameters)
        assert diff.delta.comm_us == pytest.approx(fsdp.totals.comm_us - ddp.totals.comm_us)
        assert diff.delta.compute_us == pytest.approx(
            fsdp.totals.compute_us - ddp.totals.compute_us
        )
        assert diff.delta.total_us == pytest.approx(fsdp.totals.total_us - ddp.totals.total_us)
        # the unconstrained plan is optimal, so the constrained one cannot be cheaper
        assert diff.delta.total_us >= -1e-4 * ddp.totals.total_us
        assert diff.moves[("R", "S(0)")] + diff.moves.get(("R", "S(1)"), 0) >= 4
        assert diff.num_moved == sum(
            1
            for name, node in ddp.nodes.items()
            if node.strategy.output != fsdp.nodes[name].strategy.output
        )
        text = str(diff)
        assert any(f"{p.name}  R -> S(" in text for p in diff.parameters)
        assert f"R -> S(0): {diff.moves[('R', 'S(0)')]} nodes" in text
        assert "comm" in text and " us" in text
        reverse = optimizer.diff_solutions(fsdp, ddp)
        assert reverse.delta.total_us == pytest.approx(-diff.delta.total_us)


# ---------------------------------------------------------------------------- prefetch


def test_prefetch_discount_lowers_objective_idempotently(fake_mesh):
    with solved_mlp(fake_mesh((4,))) as autop:
        optimizer = autop.sharding_optimizer
        plain = optimizer.get_solution().solver.objective
        original = optimizer.problem.objective.copy()
        assert optimizer.apply_prefetch_discount(0.5) > 0
        half = optimizer.resolve().solver.objective
        assert half < plain - 1.0
        optimizer.apply_prefetch_discount(0.5)
        assert optimizer.resolve().solver.objective == pytest.approx(half, rel=1e-9)
        optimizer.apply_prefetch_discount(0.0)
        free = optimizer.resolve()
        assert free.solver.objective < half
        # the plan's own totals keep the undiscounted prices
        assert free.totals.total_us > free.solver.objective
        optimizer.apply_prefetch_discount(1.0)
        assert np.allclose(optimizer.problem.objective, original, rtol=0, atol=1e-9)
        assert optimizer.resolve().solver.objective == pytest.approx(plain, rel=1e-9)
        for bad in (-0.1, 1.5):
            with pytest.raises(ValueError, match="within"):
                optimizer.apply_prefetch_discount(bad)


def test_prefetch_discount_touches_only_forward_parameter_gathers(fake_mesh):
    with solved_mlp(fake_mesh((4,))) as autop:
        optimizer = autop.sharding_optimizer
        problem = optimizer.problem
        before = problem.objective.copy()
        optimizer.apply_prefetch_discount(0.0)
        changed = set((problem.objective != before).nonzero()[0].tolist())
        assert changed
        params = set(problem.joint.params.values())
        for index, edge in enumerate(problem.tables.edges):
            for move in problem.edge_moves(index):
                if move.column not in changed:
                    continue
                assert edge.kind == "arg" and edge.consumer in problem.joint.forward_nodes
                producer = edge.producer
                while producer not in params:
                    (producer,) = producer.all_input_nodes
                assert isinstance(move.src[0], Shard) and isinstance(move.dst[0], Replicate)
                assert problem.objective[move.column] == pytest.approx(
                    before[move.column] - move.comm_us
                )


# ---------------------------------------------------------------------------- JSON


def test_get_json_of_fsdp_mlp(fake_mesh):
    with solved_mlp(fake_mesh((4,))) as autop:
        optimizer = autop.sharding_optimizer
        plan = optimizer.get_solution()
        data = json.loads(json.dumps(optimizer.get_json()))
        assert data["version"] == 1
        assert data["mesh"] == {"shape": [4], "dim_names": None}
        hardware = data["hardware"]
        assert (hardware["name"], hardware["source"], hardware["gpus_per_node"]) == (
            "h100",
            "preset",
            4,
        )
        assert hardware["flops_bf16"] == 989e12 and hardware["collectives"] == []
        assert hardware["links"]["intra"] == {"latency_us": 2.0, "bandwidth": 450e9}
        for key in ("total_us", "comm_us", "compute_us", "transition_us"):
            assert data["totals"][key] == pytest.approx(getattr(plan.totals, key))
        assert data["solver"]["status"] == "Optimal"
        assert data["solver"]["objective_us"] == pytest.approx(plan.solver.objective)
        assert data["solver"]["num_variables"] == plan.solver.num_variables
        params = {p["name"]: p for p in data["parameters"]}
        assert set(params) == set(plan.param_placements)
        weight = params["w1.weight"]
        # sharded over the mesh (S(0) or S(1) cost the same: the solver breaks that tie)
        assert (
            weight["shape"] == [4096, 1024]
            and weight["dtype"] == "float32"
            and weight["placements"] in ("S(0)", "S(1)")
        )
        assert weight["placements"] == placement_str(plan.param_placements["w1.weight"])
        assert weight["bytes_per_device"] == 4096 * 1024 * 4 // 4 and weight["module"] == "w1"
        assert data["inputs"] == [{"index": 0, "shape": [8192, 1024], "placements": "S(0)"}]
        assert data["outputs"] == [{"index": 0, "shape": [8192, 1024], "placements": "S(0)"}]
        assert [n["name"] for n in data["nodes"]] == list(plan.nodes)
        addmm = next(n for n in data["nodes"] if n["name"] == "addmm")
        assert addmm["phase"] == "forward" and addmm["module"] == "w1"
        strategy = plan.nodes["addmm"].strategy
        assert addmm["input_placements"] == [placement_str(p) for p in strategy.inputs]
        assert addmm["placements"] == placement_str(strategy.output) == "S(0)"
        kinds = {c["kind"] for c in data["collectives"]}
        assert {"all_gather", "reduce_scatter"} <= kinds
        assert len(data["collectives"]) == len(plan.redistributions())
        gathers = [c for c in data["collectives"] if c["kind"] == "all_gather"]
        assert any(c["phase"] == "forward" for c in gathers)
        assert all(c["mesh_dims"] == [0] and c["module"] in ("w1", "w2") for c in gathers)
        assert {c["phase"] for c in data["collectives"] if c["kind"] == "reduce_scatter"} == {
            "backward"
        }
        layers = {layer["module"]: layer for layer in data["layers"]}
        assert [layer["module"] for layer in data["layers"]] == sorted(layers)
        assert {"w1", "w2"} <= set(layers)
        assert sum(layer["compute_us"] for layer in data["layers"]) == pytest.approx(
            plan.totals.compute_us
        )
        assert sum(layer["comm_us"] for layer in data["layers"]) == pytest.approx(
            plan.totals.comm_us
        )
        assert data["fallbacks"] == []
        assert set(data["constraints"]) == {"input:0", "output:0", "parameter_memory"}


def test_get_json_attributes_llama_nodes_to_layers(fake_mesh):
    config = llama_config("tiny")
    mesh = fake_mesh((2,))
    model = meta(lambda: Llama(config))
    with AutoParallel(model, lambda: torch.randint(0, config.vocab_size, (8, 32)), mesh) as autop:
        autop.add_input_constraints(BATCH_SHARDED)
        autop.add_output_constraints(BATCH_SHARDED)
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        data = autop.sharding_optimizer.get_json()
    json.dumps(data)
    modules = {layer["module"] for layer in data["layers"]}
    for name in (
        "layers.0.attention",
        "layers.0.feed_forward",
        "layers.1.attention",
        "layers.1.feed_forward",
    ):
        assert name in modules
    assert {"tok_embeddings", "output"} <= modules
    params = {p["name"]: p for p in data["parameters"]}
    assert set(params) == set(plan.param_placements)
    assert params["layers.1.attention.wq.weight"]["module"] == "layers.1.attention.wq"  # its owner
    nodes = {n["name"]: n for n in data["nodes"]}
    joint = autop.sharding_optimizer.problem.joint
    # the forward matmul of each projection belongs to its layer
    for fqn in ("layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight"):
        transpose = next(iter(joint.params[fqn].users))
        matmul = next(u for u in transpose.users if u in joint.forward_nodes)
        assert nodes[matmul.name]["module"] == module_of_parameter(fqn)
    # the gradient matmul of each weight belongs to its layer too
    grad = joint.param_grads["layers.0.feed_forward.w1.weight"]
    assert nodes[grad.name]["module"] == "layers.0.feed_forward"
    assert nodes[grad.name]["phase"] == "backward"


# ---------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    "src,dst,kind,dims",
    [
        ((Shard(0), Replicate()), (Replicate(), Replicate()), "all_gather", [0]),
        ((Partial(), Replicate()), (Replicate(), Replicate()), "all_reduce", [0]),
        ((Replicate(), Partial()), (Replicate(), Shard(1)), "reduce_scatter", [1]),
        ((Shard(0), Replicate()), (Shard(1), Replicate()), "all_to_all", [0]),
        ((Replicate(), Replicate()), (Shard(0), Partial()), "local+local", [0, 1]),
        ((Shard(0), Partial()), (Replicate(), Replicate()), "all_gather+all_reduce", [0, 1]),
    ],
)
def test_collective_kind(src, dst, kind, dims):
    assert collective_kind(src, dst) == (kind, dims)


@pytest.mark.parametrize(
    "fqn,module",
    [
        ("layers.0.attention.wq.weight", "layers.0.attention"),
        ("layers.0.attention_norm.weight", "layers.0"),
        ("output.weight", "output"),
        ("w1.bias", "w1"),
        ("blocks.3.weight", "blocks.3"),
        ("scale", ""),
    ],
)
def test_module_of_parameter(fqn, module):
    assert module_of_parameter(fqn) == module
    assert owner_of_parameter(fqn) == (fqn.rsplit(".", 1)[0] if "." in fqn else "")
