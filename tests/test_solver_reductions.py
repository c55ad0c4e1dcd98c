"""Speed-ups of the planning stages and the solver that must not change the plan's optimum:
LP-first solving, the fast pair pricer behind the cost tables and the vectorized build."""

from __future__ import annotations

import logging
import math
import time

import highspy
import numpy as np
import pytest
import torch
from conftest import meta
from helpers.planning import batch_sharded

from autoparallel import AutoParallel
from autoparallel import _torch_internals as internals
from autoparallel.cost import TRANSITION_COST_US, PairPricer, direct_redistribution_cost_us
from autoparallel.models import MLP, Llama, llama_config
from autoparallel.problem.memory import estimate_memory
from autoparallel.problem.overlap import window_times
from autoparallel.solver import fixing
from autoparallel.solver import highs as highs_solver
from autoparallel.solver.fixing import dive, integral, relaxation
from autoparallel.solver.highs import (
    SolverOptions,
    _all_rows,
    _auxiliary,
    _priced,
    _run,
    _to_highs,
    solve,
)
from autoparallel.solver.plan import build_plan
from autoparallel.solver.priced import priced_plan
from autoparallel.types.tensors import TensorInfo

CONFIG = llama_config("tiny")  # 2 layers


def _without_buckets(problem, use_routes: bool = True):
    """``problem`` built again with every collective at its own latency (no buckets: those
    reprice pair-encoded edges only, so the encodings' optima differ by design), with the
    same user constraints (node columns come first in both)."""
    from autoparallel.problem.build import build_problem

    rebuilt = build_problem(
        problem.joint,
        problem.space,
        problem.tables,
        problem.folding,
        use_routes=use_routes,
        price_buckets=False,
    )
    for constraint in problem.user_constraints.values():
        rebuilt.add_constraint(constraint)
    return rebuilt


NARROW = llama_config("tiny", dim=48, n_heads=3, n_kv_heads=3, ffn_hidden=64)
"""The tiny LLaMA's 2 layers, narrower: the same problem size, an exact MIP with
recomputation 3x quicker to solve."""


def _autop(mesh, hardware: str | None = None, config=CONFIG) -> AutoParallel:
    model = meta(lambda: Llama(config))
    inputs = lambda: torch.randint(0, config.vocab_size, (8, 32))  # noqa: E731
    autop = AutoParallel(model, inputs, mesh, hardware=hardware)
    autop.__enter__()
    inp = batch_sharded(mesh.ndim)
    autop.add_input_constraints([inp])
    autop.add_output_constraints([inp])
    autop.add_parameter_memory_constraint()
    return autop


def test_lp_first_reaches_the_mip_optimum(fake_mesh):
    problem = _without_buckets(_autop(fake_mesh((2, 2))).sharding_optimizer.problem)
    lp_first = SolverOptions(lp_first=True, lp_first_min_variables=0)
    outcome = _run(problem, list(problem.user_constraints), lp_first)
    assert outcome.status == "Optimal"
    assert outcome.method == "lp"  # the relaxation was integral
    relaxed = solve(problem, lp_first)
    mip = solve(problem, SolverOptions(lp_first=False))
    assert relaxed.stats.objective == pytest.approx(mip.stats.objective, rel=1e-9)
    assert relaxed.stats.bound == relaxed.stats.objective and relaxed.stats.gap == 0.0
    assert relaxed.stats.method == "lp" and mip.stats.method == "mip"
    # the LP's choice is a valid plan of that price: re-price it from the tables
    tables = problem.tables
    total = sum(tables.compute_us[n][s] for n, s in relaxed.choice.items())
    for edge in tables.edges:
        i = edge.src_of_strategy[relaxed.choice[edge.producer]]
        j = edge.dst_of_strategy[relaxed.choice[edge.consumer]]
        total += next(c + t for a, b, c, t in edge.pairs if (a, b) == (i, j))
    for window, share in zip(problem.overlap_windows, problem.overlap_shares):
        total -= share * window_times(problem, window, relaxed.choice)[1]  # comm discounted
    assert total == pytest.approx(relaxed.stats.objective, rel=1e-9)


def test_small_problems_go_straight_to_the_mip(fake_mesh):
    problem = _autop(fake_mesh((2,))).sharding_optimizer.problem
    assert problem.num_variables < SolverOptions().lp_first_min_variables
    outcome = _run(problem, list(problem.user_constraints), SolverOptions())
    assert outcome.status == "Optimal" and outcome.method == "mip"
    assert outcome.highs.getOptionValue("solve_relaxation")[1] is False


def _budgeted(mesh):
    """The tiny LLaMA's problem under a budget of 70 % of its budget-free plan's peak (it
    binds), and that budget."""
    optimizer = _autop(mesh).sharding_optimizer
    optimizer.remove_constraints(["parameter_memory"])
    budget = 0.7 * optimizer.resolve().memory.peak
    optimizer.add_memory_constraint(budget)
    return optimizer.problem, budget


def test_recomputation_under_a_budget_is_planned_near_the_exact_optimum(fake_mesh, monkeypatch):
    """With recomputation a choice of the solver, the relaxation spreads the recompute counts
    over fractions of a layer; branching on them and fixing gives a plan within fix_gap of
    the exact MIP's, whose counts are whole and whose peak meets the budget. Where relax
    and fix fixes a strategy for every node class, what is left is solved as an LP."""
    from helpers.planning import budget_only_recomputing_meets

    optimizer = _autop(fake_mesh((2,)), config=NARROW).sharding_optimizer
    optimizer.remove_constraints(["parameter_memory"])
    budget = budget_only_recomputing_meets(optimizer)
    optimizer.add_memory_constraint(budget, activation_checkpointing="auto")
    problem = optimizer.problem
    whole = []
    fixed_whole = fixing._fixed_whole

    def spy(*args, **kwargs):
        found = fixed_whole(*args, **kwargs)
        whole.append(found)
        return found

    monkeypatch.setattr(fixing, "_fixed_whole", spy)
    options = SolverOptions(lp_first_min_variables=0)
    found = solve(problem, options)
    exact = solve(problem, SolverOptions(lp_first=False))
    assert found.stats.method == "lp+fix"
    assert any(w is not None and w[1] is not None for w in whole)  # the LP gave the plan
    # each bound is below the other's plan (the exact MIP stops within its relative_gap)
    assert found.stats.bound <= exact.stats.objective + 1e-6
    assert exact.stats.bound <= found.stats.objective + 1e-6
    assert found.stats.objective <= exact.stats.objective * (1 + options.fix_gap)
    counts = {k: v for k, v in found.auxiliary.items() if ":" not in k}
    assert counts and all(v == round(v) for v in counts.values()) and sum(counts.values()) >= 1
    memory = estimate_memory(
        problem,
        found.choice,
        recompute_counts={k.removeprefix("recompute "): int(v) for k, v in counts.items()},
    )
    assert memory.recomputed and memory.peak <= budget * (1 + 1e-9)


@pytest.mark.parametrize(
    "options, method",
    [
        (SolverOptions(lp_first_min_variables=0), "lp+fix"),
        (SolverOptions(lp_first_min_variables=0, priced_search=False), "lp+fix"),
        # a relaxation that does not finish at once: the priced search from scratch
        (SolverOptions(lp_first_min_variables=0, budget_relaxation_wait_s=0.0), "lp+price"),
    ],
)
def test_a_binding_memory_budget_is_met_near_the_exact_optimum(fake_mesh, options, method):
    """A budget that binds leaves the relaxation fractional. Fixing what the relaxation
    chose above 0.5, or (where the relaxation is slow) pricing the budget into the
    objective, gives a plan within the budget and within fix_gap of the exact MIP's."""
    problem, budget = _budgeted(fake_mesh((4,)))
    found = solve(problem, options)
    exact = solve(problem, SolverOptions(lp_first=False))
    assert found.stats.method == method
    assert found.stats.bound <= exact.stats.objective + 1e-6 <= found.stats.objective + 2e-6
    assert found.stats.objective <= exact.stats.objective * (1 + options.fix_gap)
    assert estimate_memory(problem, found.choice).peak <= budget * (1 + 1e-9)


def test_the_priced_search_at_the_relaxations_duals_meets_the_budget(fake_mesh):
    """Where fixing finds nothing close enough, the budget priced at the relaxation's duals
    (then scaled until the plan fits) gives an integral plan within the budget, no better
    than the relaxation's bound."""
    problem, budget = _budgeted(fake_mesh((4,)))
    names = list(problem.user_constraints)
    rows, auxiliary = _all_rows(problem, names), _auxiliary(problem, names)
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.passModel(_to_highs(problem, rows, auxiliary))
    options = SolverOptions()
    assert relaxation(highs, options) == "Optimal"
    bound = highs.getInfo().objective_function_value
    found = _priced(priced_plan, highs, problem, rows, auxiliary, options, 60.0)
    assert found is not None and found.objective >= bound - 1e-6
    values = found.values[: problem.num_variables]
    assert np.allclose(values[problem.integrality], np.round(values[problem.integrality]))
    choice = {
        node: int(np.argmax(values[columns])) for node, columns in problem.node_columns.items()
    }
    assert estimate_memory(problem, choice).peak <= budget * (1 + 1e-9)


def test_a_polishing_branch_and_bound_stops_at_its_limit_with_the_plan_in_hand(fake_mesh):
    """With no relax-and-fix plan accepted (fix_gap 0), the full MIP only polishes the plan
    found before it, for at most polish_time_s: stopped at once, the plan is still within
    the budget and says how far from the bound it is."""
    autop = _autop(fake_mesh((4,)))
    optimizer = autop.sharding_optimizer
    optimizer.remove_constraints(["parameter_memory"])
    budget = 0.7 * optimizer.resolve().memory.peak
    optimizer.add_memory_constraint(budget)
    problem = optimizer.problem
    options = SolverOptions(
        lp_first_min_variables=0, priced_search=False, fix_gap=0.0, polish_time_s=0.0
    )
    outcome = _run(problem, list(problem.user_constraints), options)
    assert outcome.method == "mip" and outcome.polish_s == 0.0
    # HiGHS was told to stop at once (its limit counts all its runs so far), not at 300 s
    limit = outcome.highs.getOptionValue("time_limit")[1]
    assert limit < outcome.highs.getRunTime() + 1.0 < options.time_limit_s
    polished = solve(problem, options)
    assert estimate_memory(problem, polished.choice).peak <= budget * (1 + 1e-9)
    assert polished.stats.bound <= polished.stats.objective
    assert polished.stats.gap == pytest.approx(
        (polished.stats.objective - polished.stats.bound) / polished.stats.objective, abs=1e-6
    )


def test_a_solve_from_an_earlier_basis_reaches_the_same_optimum(fake_mesh):
    """ShardingOptimizer.resolve's refits start from the last relaxation's basis: at other
    prices the relaxation's optimum is the cold solve's, and at the same prices it is the same
    plan. (Where that relaxation is fractional, as on torch 2.11's strategies, the warm solve
    may keep the last plan within ``fix_gap`` of the bound instead of fixing afresh.)"""
    problem = _autop(fake_mesh((2, 2))).sharding_optimizer.problem
    options = SolverOptions(lp_first_min_variables=0)
    first = solve(problem, options)
    assert first.warm_start is not None
    again = solve(problem, options, warm_start=first)
    assert again.stats.objective == pytest.approx(first.stats.objective)
    assert again.choice == first.choice
    problem.objective = problem.objective * 1.5 + 0.25  # other prices, same rows and columns
    cold = solve(problem, options)
    warm = solve(problem, options, warm_start=first)
    assert warm.stats.bound == pytest.approx(cold.stats.bound, rel=1e-9)
    assert cold.stats.bound <= warm.stats.objective <= cold.stats.bound * (1 + options.fix_gap)
    if cold.stats.method == "lp":  # an integral relaxation: its optimum is the plan
        assert warm.stats.objective == pytest.approx(cold.stats.objective, rel=1e-9)
    assert first.warm_start.cold_s > 0  # what the first relaxation took from no basis


def test_a_refit_keeps_the_last_plan_within_the_fix_gap_of_the_new_bound(fake_mesh):
    """After the prices are refitted to a plan, the re-solve prices that plan at the new
    prices (the LP's own costs) and keeps it when it is within fix_gap of the relaxation's
    bound, instead of running relax and fix again."""
    problem = _autop(fake_mesh((2, 2))).sharding_optimizer.problem
    options = SolverOptions(lp_first_min_variables=0)
    first = solve(problem, options)
    assert first.warm_start.plan_values is not None
    problem.objective = problem.objective * 1.5 + 0.25  # refitted prices, same rows
    outcome = _run(problem, list(problem.user_constraints), options)
    lp = outcome.highs.getLp()
    values = first.warm_start.plan_values
    priced = float(np.dot(lp.col_cost_, values) + lp.offset_)
    # the plan's cost at the new prices: 1.5 x its cost at the old ones + 0.25 a column used
    assert len(values) == problem.num_variables  # no auxiliary columns here
    assert priced == pytest.approx(
        1.5 * (first.stats.objective - lp.offset_) + 0.25 * values.sum() + lp.offset_
    )
    kept = highs_solver._kept_plan(outcome.highs, first.warm_start, priced * 0.995, options)
    assert kept is not None and kept.objective == pytest.approx(priced)
    assert highs_solver._kept_plan(outcome.highs, first.warm_start, priced * 0.9, options) is None
    assert highs_solver._kept_plan(outcome.highs, None, priced, options) is None


def test_a_warm_start_that_does_not_pay_starts_again_cold(fake_mesh, monkeypatch, caplog):
    """A refit's relaxation from the last basis that runs past its allowance (here none at
    all) is dropped and solved from no basis: the same optimum as a cold solve."""
    problem = _autop(fake_mesh((2, 2))).sharding_optimizer.problem
    options = SolverOptions(lp_first_min_variables=0)
    first = solve(problem, options)
    problem.objective = problem.objective * 1.5 + 0.25
    cold = solve(problem, options)
    monkeypatch.setattr(highs_solver, "WARM_START_MIN_S", 0.0)
    monkeypatch.setattr(highs_solver, "WARM_START_FACTOR", 0.0)
    with caplog.at_level(logging.INFO, logger="autoparallel.solver.highs"):
        warm = solve(problem, options, warm_start=first)
    assert "starting it again cold" in caplog.text
    assert warm.stats.bound == pytest.approx(cold.stats.bound, rel=1e-9)
    assert cold.stats.bound <= warm.stats.objective <= cold.stats.bound * (1 + options.fix_gap)
    if cold.stats.method == "lp":  # an integral relaxation: its optimum is the plan
        assert warm.stats.objective == pytest.approx(cold.stats.objective, rel=1e-9)


def test_cost_tables_hold_the_reference_prices(fake_mesh):
    autop = _autop(fake_mesh((2, 2)))
    problem = autop.sharding_optimizer.problem
    topology = problem.tables.topology
    checked = 0
    pricers: dict = {}
    for edge in problem.tables.edges:
        value = edge.producer.meta["val"]
        if not isinstance(value, torch.Tensor):
            continue
        tensor = TensorInfo(tuple(value.shape), value.dtype)
        pricer = pricers.setdefault(tensor, PairPricer(tensor, topology))
        priced = {(i, j): (c, t) for i, j, c, t in edge.pairs}
        for i, src in enumerate(edge.src_options):
            for j, dst in enumerate(edge.dst_options):
                expected = (0.0, 0.0) if src == dst else pricer.price(src, dst)
                if math.isinf(expected[0]):
                    assert (i, j) not in priced
                    continue
                assert priced[(i, j)] == expected
                if (
                    src != dst
                    and pricer.state_of(src) is not None
                    and pricer.state_of(dst) is not None
                ):
                    route = pricer.route(src, dst)
                    assert expected[1] == pytest.approx(TRANSITION_COST_US * (len(route) - 1))
                checked += 1
    assert checked > 10_000


def test_vectorized_build_prices_every_column_as_the_loop_did(fake_mesh):
    """build_problem sums costs with numpy per shared price list; the objective must be the
    member-by-member sum, and each edge's marginal rows must pair its columns with the
    producer's (consumer's) strategies of the same option."""
    import numpy as np

    config = llama_config("tiny", n_layers=4)
    model = meta(lambda: Llama(config))
    with AutoParallel(
        model, lambda: torch.randint(0, config.vocab_size, (8, 32)), fake_mesh((2, 2))
    ) as autop:
        problem = _without_buckets(autop.sharding_optimizer.problem)
    assert problem.folding.num_folded > 0
    expected = [0.0] * problem.num_variables
    for node, columns in problem.node_columns.items():
        for column, cost in zip(columns, problem.tables.compute_us[node]):
            expected[column] += cost
    for index, (edge, columns) in enumerate(zip(problem.tables.edges, problem.edge_columns)):
        if problem.edge_encoding(index) == "routes":
            for column, comm in zip(columns, edge.routes.table.arc_comm):
                expected[column] += comm + TRANSITION_COST_US
            continue
        for column, (_, _, comm, transition) in zip(columns, edge.pairs):
            expected[column] += comm + transition
    expected = np.array(expected)
    for window, share in zip(problem.overlap_windows, problem.overlap_shares):
        np.subtract.at(expected, window.comm_row.columns, share * window.comm_row.values)
    np.testing.assert_allclose(problem.objective, expected, rtol=1e-12, atol=1e-9)
    rows = {tuple(r.columns.tolist()): r for r in problem.rows}
    edge, columns = next(
        (e, c)
        for i, (e, c) in enumerate(zip(problem.tables.edges, problem.edge_columns))
        if len(e.src_options) > 2 and problem.edge_encoding(i) == "pairs"
    )
    producer_columns = problem.node_columns[edge.producer]
    for option in range(len(edge.src_options)):
        pair_cols = [c for c, pair in zip(columns, edge.pairs) if pair[0] == option]
        node_cols = [c for c, o in zip(producer_columns, edge.src_of_strategy) if o == option]
        row = rows[tuple(pair_cols + node_cols)]
        assert row.values.tolist() == [1.0] * len(pair_cols) + [-1.0] * len(node_cols)
        assert row.lower == row.upper == 0.0


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4)])
def test_single_dim_ops_expand_as_dtensor_does(fake_mesh, monkeypatch, shape):
    """Ops DTensor describes by single-mesh-dim rules are multiplied out over the mesh by
    us (no redistribution pricing); every node must get the very strategies DTensor's own
    expander gives."""
    from autoparallel.strategies import dtensor_adapter
    from autoparallel.strategies.space import build_strategy_space
    from autoparallel.trace.export import trace_joint

    mesh = fake_mesh(shape)
    model = meta(lambda: Llama(CONFIG))
    joint = trace_joint(
        model, lambda: torch.randint(0, CONFIG.vocab_size, (8, 32)), torch.device("cpu")
    )
    asked_dtensor = []
    real_call = dtensor_adapter._call

    def spy(strategy_fn, node, *args):
        asked_dtensor.append(node)
        return real_call(strategy_fn, node, *args)

    monkeypatch.setattr(dtensor_adapter, "_call", spy)
    ours = build_strategy_space(joint, mesh)
    monkeypatch.setattr(dtensor_adapter, "_call", real_call)
    # no single-dim op of this model needed DTensor's expander (the fallback)
    assert not [n.name for n in asked_dtensor if internals.has_single_dim_strategy(n.target)]
    monkeypatch.setattr(dtensor_adapter, "_USE_DTENSOR_EXPANDER", True)
    theirs = build_strategy_space(joint, mesh)
    assert list(ours.nodes) == list(theirs.nodes)
    single_dim = 0
    for node, strategies in ours.nodes.items():
        # repr, not ==: a _MaskPartial equals only placements sharing its mask buffer, and
        # each strategy query makes a new one
        mine = [repr((s.output, s.inputs)) for s in strategies.strategies]
        reference = [repr((s.output, s.inputs)) for s in theirs.nodes[node].strategies]
        assert set(mine) == set(reference), node.name
        assert mine == reference, node.name  # same order too: the plan cannot change
        if isinstance(node.target, torch._ops.OpOverload) and internals.has_single_dim_strategy(
            node.target
        ):
            single_dim += 1
    assert single_dim > 10
    assert ours.fallbacks == theirs.fallbacks


def _mlp_autop(mesh) -> AutoParallel:
    autop = AutoParallel(meta(lambda: MLP(64, 256)), lambda: torch.randn(64, 64), mesh)
    autop.__enter__()
    autop.add_input_constraints([batch_sharded(mesh.ndim)])
    autop.add_parameter_memory_constraint()
    return autop


@pytest.mark.parametrize(("model", "shape"), [("llama", (2, 4)), ("mlp", (2, 2, 2))])
def test_route_flows_keep_the_optimum_of_pair_pricing(fake_mesh, model, shape):
    """Edges priced as flows over single-step route arcs must give exactly the optimum of the
    same problem priced on placement pairs, with fewer variables; each route of the plan is
    single-dim steps that cost what the plan says."""
    autop = (_autop if model == "llama" else _mlp_autop)(fake_mesh(shape))
    flows = _without_buckets(autop.sharding_optimizer.problem)
    assert "routes" in flows.edge_encodings
    pairs = _without_buckets(flows, use_routes=False)
    assert set(pairs.edge_encodings) == {"pairs"}
    assert flows.num_variables < pairs.num_variables
    options = SolverOptions(time_limit_s=600)
    by_flows, by_pairs = solve(flows, options), solve(pairs, options)
    assert by_flows.stats.status == by_pairs.stats.status == "Optimal"
    assert by_flows.stats.objective == pytest.approx(by_pairs.stats.objective, rel=1e-9)
    plan = build_plan(flows, by_flows, None)
    nodes = {node.name: node for node in flows.space.nodes}
    for _, argument in plan.redistributions():
        value = nodes[argument.producer].meta["val"]
        if not isinstance(value, torch.Tensor):
            continue
        tensor = TensorInfo(tuple(value.shape), value.dtype)
        steps = argument.steps
        assert all(sum(a != b for a, b in zip(x, y)) == 1 for x, y in steps) or not argument.route
        cost = sum(
            direct_redistribution_cost_us(tensor, x, y, flows.tables.topology) for x, y in steps
        )
        assert cost == pytest.approx(argument.comm_us, rel=1e-9, abs=1e-9)


def test_route_flows_keep_the_optimum_under_reduce_dtype_constraints(fake_mesh):
    """The mixed-precision rule (no reduction before the cast to reduce_dtype) forbids
    reducing pairs on pair edges and reducing steps on flow edges: same optimum both ways,
    on a mesh whose dim 0 crosses nodes (so routes differ from direct moves)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autoparallel.problem.build import build_problem
    from autoparallel.problem.constraints import reduction_dtype_constraints

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = fake_mesh((2, 4))
    model = meta(lambda: Llama(CONFIG))
    with AutoParallel(
        model,
        lambda: torch.randint(0, CONFIG.vocab_size, (8, 32)),
        mesh,
        mp_policy=policy,
        gpus_per_node=4,
    ) as autop:
        autop.add_input_constraints([batch_sharded(2)])
        autop.add_parameter_memory_constraint()
        flows = _without_buckets(autop.sharding_optimizer.problem)
    assert "routes" in flows.edge_encodings
    by_flows = solve(flows, SolverOptions()).stats
    pairs = build_problem(
        flows.joint, flows.space, flows.tables, flows.folding, use_routes=False, price_buckets=False
    )
    for name, constraint in flows.user_constraints.items():
        if not name.startswith("mixed_precision:"):
            pairs.add_constraint(constraint)
    reduce_rules = reduction_dtype_constraints(pairs, policy)
    assert (
        len(reduce_rules)
        == sum(1 for name in flows.user_constraints if name.startswith("mixed_precision:"))
        > 0
    )
    for constraint in reduce_rules:
        pairs.add_constraint(constraint)
    by_pairs = solve(pairs, SolverOptions(time_limit_s=600)).stats
    assert by_flows.status == by_pairs.status == "Optimal"
    assert by_flows.objective == pytest.approx(by_pairs.objective, rel=1e-9)


def test_the_dive_fixes_a_fractional_relaxation_near_the_optimum(fake_mesh):
    """The dive fixes one node class at a time and re-solves the relaxation until it is
    integral: a plan (one strategy per node class) within fix_gap of the relaxation's bound
    (so of the optimum), with the column bounds left as it found them."""
    problem = _autop(fake_mesh((2, 2)), "cpu").sharding_optimizer.problem
    options = SolverOptions(lp_first_min_variables=0)
    names = list(problem.user_constraints)
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("threads", options.threads)
    highs.passModel(_to_highs(problem, _all_rows(problem, names), _auxiliary(problem, names)))
    assert relaxation(highs, options) == "Optimal"
    assert not integral(highs, problem, None, options)  # the parameter budget binds
    bound = float(highs.getInfo().objective_function_value)
    relaxed = np.asarray(highs.getSolution().col_value)
    lower, upper = np.array(highs.getLp().col_lower_), np.array(highs.getLp().col_upper_)

    plan = dive(highs, problem, None, options, time.perf_counter() + 60.0, relaxed, bound)

    assert plan is not None
    assert bound <= plan.objective + 1e-9 and plan.gap(bound) <= options.fix_gap
    for columns in problem.node_columns.values():
        assert sorted(np.round(plan.values[columns], 6)) == [0.0] * (len(columns) - 1) + [1.0]
    assert np.array_equal(highs.getLp().col_lower_, lower)
    assert np.array_equal(highs.getLp().col_upper_, upper)


@pytest.mark.parametrize(
    "budget, share, method",
    [(False, 1.01, "lp+dive"), (True, 0.0, "lp+dive"), (True, 1.01, "lp+fix")],
    ids=["no-budget", "budget-large-mip", "budget-small-mip"],
)
def test_the_dive_goes_first_unless_a_budget_leaves_relax_and_fix_a_small_mip(
    fake_mesh, monkeypatch, budget, share, method
):
    """Without a peak-memory budget the fractional classes are ties between plans of one
    price: the dive runs first and its plan is kept within fix_gap. Under a budget it runs
    first only where relax and fix would leave at least DIVE_UNFIXED_SHARE of the node
    classes (no strategy above 0.5) to its MIP."""
    if budget:
        problem, _ = _budgeted(fake_mesh((4,)))
    else:
        problem = _autop(fake_mesh((2, 2)), "cpu").sharding_optimizer.problem
    assert (problem.memory_budget is not None) == budget
    monkeypatch.setattr(fixing, "DIVE_UNFIXED_SHARE", share)
    found = solve(problem, SolverOptions(lp_first_min_variables=0))
    assert found.stats.method == method
    assert found.stats.bound <= found.stats.objective
    assert found.stats.gap <= SolverOptions().fix_gap
