"""The pipeline side of ``AutoParallel`` (orchestration; the algorithms are in
stage_setup.py, cost/pipeline.py and trace/stages.py).

With a "pp" mesh dim, ``AutoParallel`` (api.py) takes this class's methods:

    __enter__ step 0: _take_stage    cut the model for the setting planned now, take this
                                     rank's stage (stage_setup.py)
    __enter__ step 8: _pin_cuts      the tensors crossing a cut keep the layout both stages
                                     expect
    optimize_placement: _plan_pipeline
        for each setting of ``pipeline_settings`` (one where the user fixed microbatches):
            plan this rank's stage under it (cut and traced again, the user's recorded
            constraint calls replayed), and its other stages where it runs several
            -> every stage's price: exchanged over the pp group, or on a fake mesh (no peer
               plans the other stages) planned here, stages that plan alike once
        -> the fastest setting within the memory budget (cost/pipeline.py's choose_option)
        -> two stages per rank (_interleaved): where its stages cut in halves are
           predicted faster, the kept microbatches under interleaved 1F1B, planned and
           priced the same way, kept if faster
        -> the cuts (_even_out): the layers moved to even out its stages' prices
           (balanced_layers), that split planned and priced the same way, kept if faster
        -> this object left holding the kept setting's stage, problem and plan (and its
           other stages' objects and plans, ``_local_stages``)

Ordering contract: the stage's graph depends on the setting (its microbatch's shapes), so a
setting other than the first is planned by entering again; the user's constraints were
written against the first and are replayed, which is why the public constraint methods are
``@recorded``. A constraint added on the sharding optimizer directly cannot be replayed (it
names nodes of one stage's graph): then only the first setting is planned.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoparallel.cost.pipeline import (
    balanced_layers,
    choose_option,
    halved_stages_step,
    microbatches_in_flight,
    price_stages,
)
from autoparallel.cost.topology import Topology
from autoparallel.solver.highs import InfeasibleConstraintsError
from autoparallel.stage_setup import (
    StageCut,
    StageSetup,
    boundary_placements,
    check_setting,
    cut_model,
    exchanged_prices,
    pipeline_settings,
    same_stage_graph,
    stage_price,
)
from autoparallel.trace.stages import StageTracer
from autoparallel.types.pipeline import (
    INTERLEAVED,
    INTERLEAVED_STAGES_PER_RANK,
    PipelineConfig,
    PipelineError,
    PipelineOption,
    ScheduleName,
    StagePrice,
)
from autoparallel.types.plan import Plan

logger = logging.getLogger(__name__)

CUT_ROUNDS = 3
"""New layer splits the planner prices after the even one (each one a cut and a plan)."""
CUT_MIN_GAIN = 0.02
"""A new split is planned only where it is predicted to make the slowest stage this much
faster (a share of its time)."""


@dataclass(frozen=True)
class _ConstraintCall:
    """A constraint call of the public API, kept to be replayed on the stage of another
    pipeline setting; ``names``: the constraints it added."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    names: tuple[str, ...]


Priced = tuple[dict[str, Any], Plan | None, list[StagePrice | None]]
"""A setting planned: what ``_priced`` left on the object (``_state``), the plan of this
rank's first stage, and every stage's price."""


@dataclass
class _Search:
    """The settings one ``optimize_placement`` has planned and priced so far (``tried[i]``
    priced as ``options[i]``), and what planning another one needs."""

    tried: list[Priced]
    options: list[PipelineOption]
    calls: list[_ConstraintCall]
    verbose: bool
    errors: list[InfeasibleConstraintsError]
    budget: float | None


def _cut_by(setting: PipelineConfig) -> tuple[Any, ...]:
    """What of a setting decides the cut (all but the schedule)."""
    return (setting.microbatches, setting.stage_layers, setting.stages_per_rank)


def recorded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Record a successful call of a public constraint method (not the calls it makes)."""

    @functools.wraps(method)
    def call(self: PipelinePlanning, *args: Any, **kwargs: Any) -> Any:
        depth = len(self._calls)
        added = method(self, *args, **kwargs)
        del self._calls[depth:]
        names = tuple(added) if isinstance(added, list) else (added,)
        self._calls.append(_ConstraintCall(method.__name__, args, kwargs, names))
        return added

    return call


class PipelinePlanning:
    """The pipeline methods of ``AutoParallel`` (see the module docstring); they read its
    ``_whole`` (model, input_fn, mesh, hardware, gpus_per_node as given), ``mp_policy``,
    ``_planner_options`` and its per-stage state (``_state``)."""

    _setting: PipelineConfig | None
    _cut: StageCut | None
    _stage_index: int | None
    stage_setup: StageSetup | None
    pipeline_config: PipelineConfig | None
    # with several stages per rank: this rank's other stages, each planned on an object of
    # its own, with its plan (apply_placement builds their modules beside this one's)
    _local_stages: tuple[tuple[Any, Plan], ...]
    # cuts the whole model, keeping one export per microbatch shape (made on first use)
    _tracer: StageTracer | None
    _whole_topology: Topology
    _calls: list[_ConstraintCall]

    def _take_stage(self) -> None:
        model, input_fn, mesh, hardware, gpus_per_node = self._whole
        if self._setting is None or self._cut is None or self._cut.config != self._setting:
            inputs = input_fn()
            if self._setting is None:
                self._setting = pipeline_settings(inputs, mesh, self.pipeline_config)[0]
            if self._tracer is None:
                self._tracer = StageTracer(model, self._dtype())
            self._cut = self._timed(
                "cut", lambda: cut_model(self._tracer, inputs, mesh, self._setting)
            )
        self.stage_setup = self._cut.take(mesh, self._stage_index)
        self.model = self.stage_setup.stage.module
        self.input_fn = self.stage_setup.input_fn
        self.mesh = self.stage_setup.mesh
        self.topology = Topology.from_mesh(
            self.mesh, hardware=hardware, gpus_per_node=gpus_per_node
        )
        logger.info(
            "pipeline: %s; planning stage %d (%s) on %s",
            self.stage_setup.pipeline_plan().describe(),
            self.stage_setup.stage.index,
            ", ".join(self.stage_setup.stage.layers),
            self.mesh.mesh_dim_names,
        )

    def _dtype(self) -> Any:
        return None if self.mp_policy is None else self.mp_policy.param_dtype

    def _hold_in_flight(self) -> None:
        """The stage's memory counts the microbatches its schedule keeps in flight."""
        problem, setup = self.sharding_optimizer.problem, self.stage_setup
        problem.activation_copies = setup.in_flight
        problem.memory = None  # built on first use, with them

    def _pin_cuts(self) -> None:
        setup, joint = self.stage_setup, self.sharding_optimizer.problem.joint
        if not setup.is_first:
            pinned = boundary_placements(setup, list(setup.stage.example_inputs), self.mesh.ndim)
            self._add_boundary_constraints(pinned, joint.user_inputs, "input")
        if not setup.is_last:
            values = [None if o is None else o.meta["val"] for o in joint.user_outputs]
            pinned = boundary_placements(setup, values, self.mesh.ndim)
            nodes = [joint.tangents.get(i, out) for i, out in enumerate(joint.user_outputs)]
            self._add_boundary_constraints(pinned, nodes, "output")

    def add_pipeline_constraint(
        self,
        schedule: ScheduleName | None = None,
        microbatches: int | None = None,
        stage_layers: tuple[int, ...] | None = None,
        stages_per_rank: int | None = None,
    ) -> str:
        """With a "pp" mesh dim: fix the schedule ("gpipe", "1f1b" or "interleaved-1f1b"),
        the microbatches per step, how many layers of the layer stack each stage runs,
        and/or how many stages each pp rank runs (see :class:`PipelineConfig`). Call it
        before any other constraint: the stages are cut and traced again. Raises
        PipelineError for a mesh without "pp", a setting that cannot run (more stages than
        layers, microbatches that do not divide the local batch, several stages per rank
        without the interleaved schedule), or constraints already added."""
        if self.pipeline_config is None:
            raise PipelineError(
                "add_pipeline_constraint needs a mesh whose first dim is named 'pp'"
            )
        added = sorted(set(self.sharding_optimizer.constraints()) - self._entered_constraints)
        if added:
            raise PipelineError(
                "add_pipeline_constraint must come before the other constraints (the stages "
                f"are traced again); already added: {', '.join(added)}"
            )
        current = self.pipeline_config
        self.pipeline_config = PipelineConfig(
            schedule if schedule is not None else current.schedule,
            microbatches if microbatches is not None else current.microbatches,
            tuple(stage_layers) if stage_layers is not None else current.stage_layers,
            stages_per_rank if stages_per_rank is not None else current.stages_per_rank,
        )
        _, input_fn, mesh, *_ = self._whole
        inputs = input_fn()
        self._setting = pipeline_settings(inputs, mesh, self.pipeline_config)[0]
        if _cut_by(self._cut.config) == _cut_by(self._setting):
            # the schedule alone: the stage and its problem stay as they are
            check_setting(self._setting, inputs, mesh)
            self._cut = dataclasses.replace(self._cut, config=self._setting)
            self.stage_setup = dataclasses.replace(self.stage_setup, config=self._setting)
            self._hold_in_flight()
        else:
            self.__enter__()
        return f"pipeline: {self.stage_setup.pipeline_plan().describe()}"

    # ------------------------------------------------------------------ pipeline planning

    def _plan_pipeline(self, verbose: bool) -> Plan:
        _, input_fn, mesh, *_ = self._whole
        calls = list(self._calls)
        replayable = self._replayable()
        settings = (
            pipeline_settings(input_fn(), mesh, self.pipeline_config)
            if replayable
            else (self._setting,)
        )
        errors: list[InfeasibleConstraintsError] = []
        tried = [self._priced(setting, calls, verbose, errors) for setting in settings]
        options = [self._option(state, prices) for state, _, prices in tried]
        budget = self.sharding_optimizer.problem.memory_budget
        search = _Search(tried, options, calls, verbose, errors, budget)
        best = choose_option(options, budget)
        if best >= 0 and replayable and self._interleaving_open():
            best = self._interleaved(search, best)
        if best >= 0 and replayable and self.pipeline_config.stage_layers is None:
            best = self._even_out(search, best)
        if best < 0:
            raise errors[0] if errors else InfeasibleConstraintsError([], [])
        state, plan, prices = tried[best]
        vars(self).update(state)
        if len(options) > 1:
            logger.info(
                "pipeline settings priced: %s; kept %s",
                "; ".join(o.describe() for o in options),
                options[best].describe(),
            )
        cost, memory = price_stages(
            self._setting.schedule,
            self._setting.microbatches,
            prices,
            self._setting.stages_per_rank,
        )
        plan.pipeline = dataclasses.replace(
            self.stage_setup.pipeline_plan(),
            cost=cost,
            stage_memory=memory,
            options=tuple(options),
        )
        return plan

    def _interleaving_open(self) -> bool:
        """Whether the user left the stages per rank to the planner."""
        config = self.pipeline_config
        return (config.schedule, config.stages_per_rank, config.stage_layers) == (None,) * 3

    def _interleaved(self, search: _Search, best: int) -> int:
        """The kept setting's microbatches with two stages per rank under interleaved 1F1B,
        planned and priced where the layer stack has a layer for each stage, the
        microbatches come in whole rounds, and the kept stages cut in halves are predicted
        to be ``CUT_MIN_GAIN`` faster (cost/pipeline.py's ``halved_stages_step``); returns
        the index kept."""
        _, input_fn, mesh, *_ = self._whole
        state, _, prices = search.tried[best]
        kept = state["_setting"]
        setting = dataclasses.replace(
            kept, schedule=INTERLEAVED, stages_per_rank=INTERLEAVED_STAGES_PER_RANK
        )
        layers = sum(len(stage.layers) for stage in state["_cut"].stages)
        if layers < mesh.shape[0] * INTERLEAVED_STAGES_PER_RANK or any(p is None for p in prices):
            return best
        try:
            check_setting(setting, input_fn(), mesh)
        except PipelineError:
            return best
        guess = halved_stages_step(prices, kept.microbatches, INTERLEAVED_STAGES_PER_RANK)
        if guess > (1 - CUT_MIN_GAIN) * search.options[best].step_us:
            return best
        return self._price_another(search, setting)

    def _even_out(self, search: _Search, best: int) -> int:
        """The cuts: from the kept setting's stage prices, the layers per stage that even
        them out (cost/pipeline.py's ``balanced_layers``) are planned and priced, again from
        the new kept one, until a split comes back or is predicted to gain less than
        ``CUT_MIN_GAIN`` (at most ``CUT_ROUNDS`` new splits); returns the index kept."""
        for _ in range(CUT_ROUNDS):
            state, _, prices = search.tried[best]
            if any(p is None for p in prices):
                break
            split, slowest = balanced_layers(prices, search.options[best].stage_layers)
            now = max(p.microbatch_us for p in prices)
            if slowest > (1 - CUT_MIN_GAIN) * now or any(
                o.stage_layers == split for o in search.options
            ):
                break
            best = self._price_another(
                search, dataclasses.replace(state["_setting"], stage_layers=split)
            )
        return best

    def _price_another(self, search: _Search, setting: PipelineConfig) -> int:
        """Plan and price ``setting`` into ``search``; the index of the option kept now."""
        priced = self._priced(setting, search.calls, search.verbose, search.errors)
        search.tried.append(priced)
        search.options.append(self._option(priced[0], priced[2]))
        return choose_option(search.options, search.budget)

    def _priced(
        self,
        setting: PipelineConfig,
        calls: list[_ConstraintCall],
        verbose: bool,
        errors: list[InfeasibleConstraintsError],
    ) -> Priced:
        """Plan this rank's stages under ``setting`` (its first on this object, entering
        again for another than the current setting, ``calls`` replayed; its others, with
        more than one stage per rank, on objects of their own kept in ``_local_stages``)
        and price every stage; leaves this object in that state and returns it
        (``_state``), the plan and the prices. Collective over the pp group on a real mesh:
        every rank prices the same settings in the same order."""
        plan, mine = None, None
        try:
            if setting != self._setting:
                self._setting = setting
                self.__enter__()
                self._replay(calls)
            plan = self._solve(verbose)
            mine = stage_price(
                self.stage_setup, plan, self.joint, self._outputs(), self._whole_topology
            )
        except InfeasibleConstraintsError as error:
            errors.append(error)
        others = self.stage_setup.rank_stages[1:]
        # its other stages (with several per rank), unless its first has no plan
        local = [self._stage_planned_here(i, calls) for i in others] if mine is not None else []
        self._local_stages = tuple((other, p) for _, other, p in local)
        rank_prices = [mine, *(price for price, _, _ in local)]
        rank_prices += [None] * (1 + len(others) - len(rank_prices))
        prices = exchanged_prices(rank_prices, self.stage_setup)
        if prices is None:
            prices = self._stages_planned_here(mine, calls, dict(zip(others, local)))
        return self._state(), plan, prices

    def _option(self, state: dict[str, Any], prices: list[StagePrice | None]) -> PipelineOption:
        """A priced setting (``state``: what ``_priced`` left, its cut's layers per stage)."""
        setting = state["_setting"]
        layers = tuple(len(stage.layers) for stage in state["_cut"].stages)
        per_rank = setting.stages_per_rank
        if any(p is None for p in prices):
            return PipelineOption(
                setting.schedule, setting.microbatches, None, None, layers, per_rank
            )
        cost, memory = price_stages(setting.schedule, setting.microbatches, prices, per_rank)
        peaks = [m.peak for m in memory if m is not None]
        peak = max(peaks) if peaks else None
        return PipelineOption(
            setting.schedule, setting.microbatches, cost.step_us, peak, layers, per_rank
        )

    def _stages_planned_here(
        self,
        mine: StagePrice | None,
        calls: list[_ConstraintCall],
        local: dict[int, tuple[StagePrice | None, Any, Plan | None]],
    ) -> list[StagePrice | None]:
        """Every stage's price where no peer plans the others (a fake mesh); ``local``: this
        rank's other stages, planned already. Stages that plan alike (stage_setup.py's
        ``same_stage_graph``) are planned once, by this process's own stage where it is one
        of them, else by the first: the one with the most microbatches in flight, so its
        plan fits the others' memory too (where a budget would let them choose faster plans,
        theirs is priced as its: an overestimate); each one's memory is its plan's with its
        own in flight."""
        if mine is None:
            return [None] * len(self._cut.stages)
        own = self.stage_setup.stage.index
        planned: dict[int, tuple[StagePrice | None, Any, Plan | None]] = {
            own: (mine, self, None),
            **local,
        }
        setting, stages = self._setting, len(self._cut.stages)
        prices: list[StagePrice | None] = []
        for index in range(stages):
            twin = next(
                (j for j in [*planned, *range(index)] if same_stage_graph(self._cut, j, index)),
                index,
            )
            if twin not in planned:
                planned[twin] = self._stage_planned_here(twin, calls)
            price, other, _ = planned[twin]
            if twin != index and price is not None:
                held = microbatches_in_flight(
                    setting.schedule,
                    index,
                    stages,
                    setting.microbatches,
                    setting.stages_per_rank,
                )
                memory = other.sharding_optimizer.memory_in_flight(held)
                if memory is not None:
                    price = dataclasses.replace(
                        price, peak_bytes=memory.peak, activation_bytes=memory.activations
                    )
            prices.append(price)
        return prices

    def _stage_planned_here(
        self, index: int, calls: list[_ConstraintCall]
    ) -> tuple[StagePrice | None, Any, Plan | None]:
        """Stage ``index`` planned on an object of its own (its price, the object, its
        plan; None, None, None where no plan is within the constraints)."""
        model, input_fn, mesh, *_ = self._whole
        other = type(self)(model, input_fn, mesh, self.mp_policy, **self._planner_options)
        other.pipeline_config = self.pipeline_config
        other._setting, other._cut, other._stage_index = self._setting, self._cut, index
        try:
            with other:
                other._replay(calls)
                plan = other._solve(verbose=False)
        except InfeasibleConstraintsError:
            return None, None, None
        price = stage_price(
            other.stage_setup, plan, other.joint, other._outputs(), self._whole_topology
        )
        return price, other, plan

    def _outputs(self) -> list[Any]:
        return [None if o is None else o.meta["val"] for o in self.joint.user_outputs]

    def _state(self) -> dict[str, Any]:
        """What planning one pipeline setting changes on this object."""
        names = ("model", "input_fn", "mesh", "topology", "stage_setup", "joint", "_optimizer")
        names += ("_entered_constraints", "_calls", "_cut", "_setting", "_local_stages")
        return {name: getattr(self, name) for name in names}

    def _replay(self, calls: list[_ConstraintCall]) -> None:
        for call in calls:
            getattr(self, call.method)(*call.args, **call.kwargs)

    def _replayable(self) -> bool:
        """Whether every constraint in force came through a recorded call (one added on the
        sharding optimizer directly names nodes of this stage's graph only)."""
        added = set(self.sharding_optimizer.constraints()) - self._entered_constraints
        recorded = {name for call in self._calls for name in call.names}
        unrecorded = added - recorded
        if unrecorded:
            logger.info(
                "pipeline: constraints %s were added on the sharding optimizer: only the "
                "setting planned first is priced",
                ", ".join(sorted(unrecorded)),
            )
        return not unrecorded
