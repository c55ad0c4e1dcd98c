"""AutoParallel: orchestration of the pipeline stages (no algorithm lives here).

    trace_joint -> build_strategy_space -> build_cost_tables -> find_repeated_nodes
        -> build_problem -> (model's and user's constraints) -> solve -> build_plan
        -> apply_placement

``__enter__`` runs the stages up to the problem, with the ordering contract beside each
step; ``optimize_placement`` solves; ``apply_placement`` builds the parallel module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autoparallel.cost.hardware import Hardware
from autoparallel.cost.tables import build_cost_tables
from autoparallel.cost.topology import Topology
from autoparallel.files.placements import check_compatible, load_placements, save_placements
from autoparallel.optimizer import ShardingOptimizer
from autoparallel.pipeline_planning import PipelinePlanning, recorded
from autoparallel.problem.build import build_problem
from autoparallel.problem.constraints import reduction_dtype_constraints, sharding_constraints
from autoparallel.problem.folding import find_repeated_nodes
from autoparallel.runtime.module import apply_placement
from autoparallel.runtime.pipeline import ParallelPipeline
from autoparallel.solver.highs import SolverOptions
from autoparallel.stage_setup import (
    StageCut,
    StageSetup,
    is_pipeline_mesh,
    with_stage_dim,
    without_pipeline_dim,
)
from autoparallel.strategies.space import build_strategy_space
from autoparallel.trace.export import trace_device, trace_joint
from autoparallel.trace.mixed_precision import check_policy
from autoparallel.types.graph import JointGraph
from autoparallel.types.kinds import ActivationCheckpointing
from autoparallel.types.pipeline import PipelineConfig, PipelineError, PipelinePlan
from autoparallel.types.placements import check_shard_dims, validate_placements
from autoparallel.types.plan import Plan

logger = logging.getLogger(__name__)


class AutoParallel(PipelinePlanning):
    """Plan the parallelization of ``model`` on ``mesh``.

    Use as a context manager: entering traces the model with the *global* inputs returned
    by ``input_fn()`` and builds the optimization problem; then add constraints and call
    :meth:`optimize_placement`::

        with AutoParallel(model, input_fn, mesh) as autop:
            autop.add_input_constraints([(Shard(0),)])
            autop.add_parameter_memory_constraint()
            plan = autop.optimize_placement(verbose=True)

    Args:
        model: the module to plan; parameters may live on the meta device (never materialized).
        input_fn: returns the global example inputs: a tensor, a tuple, or a dict of kwargs.
        mesh: the DeviceMesh to plan for (a fake process group is enough).
        mp_policy: torch's ``MixedPrecisionPolicy`` (from ``torch.distributed.fsdp``): compute in
            ``param_dtype``, reduce gradients in ``reduce_dtype``; see trace/mixed_precision.py.
        hardware: a preset name ("h100", "a100", "h200", "b200", "cpu") or a Hardware.
        gpus_per_node: ranks per node, deciding which mesh dims are inter-node.
        time_limit_s / relative_gap: solver controls (on a time-out the best plan found is
            returned with a warning).
        fold: let repeated layers share decision variables (see problem/folding.py).
        trace_layers_once: when the model's layers are identical modules, trace it with 3
            and 4 layers and build the full graph from those, checked node for node
            (see trace/repeated_layers.py, trace/layer_stamping.py); False traces every layer.
        dynamic: the parallel module also accepts inputs of other sizes than ``input_fn()``'s,
            without planning again, when the plan divides them (see runtime/dynamic.py).

    A mesh whose first dim is named ``pp`` runs the model as pipeline stages cut at its
    layer stack: each rank plans its own stage on the other dims, the microbatches, schedule
    and cuts are chosen in :meth:`optimize_placement` unless :meth:`add_pipeline_constraint`
    fixes them, and :meth:`apply_placement` returns a :class:`ParallelPipeline` (see
    pipeline_planning.py and stage_setup.py).

    An argument of the wrong type or out of range (a model that is not a module, a mesh that
    is not a DeviceMesh, a flag that is not a bool, a time limit that is not positive, an
    unknown hardware preset or a bad profile) raises TypeError, ValueError or ProfileError
    naming it, before anything is traced.
    """

    def __init__(
        self,
        model: nn.Module,
        input_fn: Callable[[], Any],
        mesh: DeviceMesh,
        mp_policy: Any = None,
        *,
        hardware: str | Hardware | None = None,
        gpus_per_node: int | None = None,
        time_limit_s: float = 300.0,
        relative_gap: float = 1e-4,
        fold: bool = True,
        dynamic: bool = False,
        trace_layers_once: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(input_fn):
            raise TypeError(
                f"input_fn must be a callable returning the global example inputs, got {type(input_fn).__name__}"
            )
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(
                f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}"
            )
        if is_pipeline_mesh(mesh):
            mesh = with_stage_dim(mesh)
        for name, flag in (
            ("fold", fold),
            ("dynamic", dynamic),
            ("trace_layers_once", trace_layers_once),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        self.model = model
        self.input_fn = input_fn
        self.mesh = mesh
        self.mp_policy = check_policy(mp_policy)
        self.topology = Topology.from_mesh(mesh, hardware=hardware, gpus_per_node=gpus_per_node)
        # with a "pp" dim, model, input_fn, mesh and topology become this rank's stage's
        # in __enter__; the whole model's are kept here
        self._whole = (model, input_fn, mesh, hardware, gpus_per_node)
        self._whole_topology = self.topology
        self._planner_options = dict(
            hardware=hardware,
            gpus_per_node=gpus_per_node,
            time_limit_s=time_limit_s,
            relative_gap=relative_gap,
            fold=fold,
            dynamic=dynamic,
            trace_layers_once=trace_layers_once,
        )
        # the user's pipeline constraint; the setting planned now (schedule and microbatches
        # decided), the model cut for it, and the stage this process plans (None: its rank's)
        self.pipeline_config = PipelineConfig() if is_pipeline_mesh(mesh) else None
        self._setting: PipelineConfig | None = None
        self._cut: StageCut | None = None
        self._stage_index: int | None = None
        self.stage_setup: StageSetup | None = None
        self._local_stages = ()
        self._tracer = None
        # the user's constraint calls since __enter__, replayed on another setting's stage
        self._calls = []
        self._entered_constraints: set[str] = set()
        self.solver_options = SolverOptions(time_limit_s=time_limit_s, relative_gap=relative_gap)
        self.fold = fold
        self.trace_layers_once = trace_layers_once
        self.dynamic = dynamic
        self.joint: JointGraph | None = None
        self._optimizer: ShardingOptimizer | None = None
        self.stage_times_s: dict[str, float] = {}

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> AutoParallel:
        self._calls = []
        # 0. Pipeline stages (a "pp" mesh dim only): cut the model and plan this rank's
        #    stage, on the mesh without pp, from here on (stage_setup.py).
        if self.pipeline_config is not None:
            self._take_stage()
        # 1. Trace: the joint forward+backward graph on fake tensors, with the roles of its
        #    boundary. Everything later reads this graph; nothing later re-traces.
        device = trace_device(self.mesh.device_type)
        self.joint = self._timed(
            "trace",
            lambda: trace_joint(
                self.model,
                self.input_fn,
                device,
                self.mp_policy,
                self.trace_layers_once,
                self.mesh,
            ),
        )
        # 2. Strategies: per node, the placements it can run with on this mesh. Depends on the
        #    graph only (shapes, ops), not on hardware.
        space = self._timed("strategies", lambda: build_strategy_space(self.joint, self.mesh))
        # 3. Cost: a price per (node, strategy) and per (edge, placement pair), on the topology.
        tables = self._timed("cost", lambda: build_cost_tables(self.joint, space, self.topology))
        # 4. Folding, before the problem: repeated layers must share columns when it is built.
        folding = (
            self._timed("fold", lambda: find_repeated_nodes(self.joint, space))
            if self.fold
            else None
        )
        # 5. Problem: the structural rows and objective (no user constraint yet).
        problem = self._timed("build", lambda: build_problem(self.joint, space, tables, folding))
        # 6. Constraints the model itself states (with_sharding_constraint, the mixed-precision
        #    policy), by name; the user's own ones are added after __enter__ returns.
        for constraint in sharding_constraints(problem, tuple(self.mesh.shape)):
            problem.add_constraint(constraint)
        if self.mp_policy is not None:
            for constraint in reduction_dtype_constraints(problem, self.mp_policy):
                problem.add_constraint(constraint)
        # 7. The facade the user constrains and solves through (solving waits for
        #    optimize_placement, so constraints can still be added).
        self._optimizer = ShardingOptimizer(problem, self.mesh.mesh_dim_names, self.solver_options)
        # 8. Pipeline stages: the tensors crossing a cut keep the layout the next stage
        #    expects (stage_setup.py), whatever else the user constrains; the stage's memory
        #    counts the microbatches in flight (before any memory model is built).
        if self.stage_setup is not None:
            self._pin_cuts()
            self._hold_in_flight()
        self._entered_constraints = set(self._optimizer.constraints())
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def _timed(self, stage: str, work: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = work()
        self.stage_times_s[stage] = time.perf_counter() - start
        logger.info("%s: %.2f s", stage, self.stage_times_s[stage])
        return result

    # ------------------------------------------------------------------ public API

    @property
    def sharding_optimizer(self) -> ShardingOptimizer:
        if self._optimizer is None:
            raise RuntimeError(
                "enter the AutoParallel context first: `with AutoParallel(...) as autop:`"
            )
        return self._optimizer

    @recorded
    def add_input_constraints(self, constraints: Sequence[Sequence | None]) -> list[str]:
        """One placement tuple per user-input tensor leaf (None leaves that input free).

        With a "pp" mesh dim the tuples are written on the whole mesh, Replicate() on pp;
        they bind the first stage (the others take the hidden states as the cut pins them).
        """
        if self.stage_setup is not None:
            constraints = without_pipeline_dim(constraints, "input", self.mesh.ndim)
            if not self.stage_setup.is_first:
                return []
        joint = self.sharding_optimizer.problem.joint
        return self._add_boundary_constraints(constraints, joint.user_inputs, "input")

    @recorded
    def add_output_constraints(self, constraints: Sequence[Sequence | None]) -> list[str]:
        """One placement tuple per user-output tensor leaf (None leaves that output free).

        A user output leaves the graph in the placement of its incoming gradient (tangent),
        so the constraint is placed on the tangent when there is one. With a "pp" mesh dim
        the tuples are written on the whole mesh and bind the last stage.
        """
        if self.stage_setup is not None:
            constraints = without_pipeline_dim(constraints, "output", self.mesh.ndim)
            if not self.stage_setup.is_last:
                return []
        joint = self.sharding_optimizer.problem.joint
        nodes = [joint.tangents.get(i, out) for i, out in enumerate(joint.user_outputs)]
        return self._add_boundary_constraints(constraints, nodes, "output")

    @recorded
    def add_parameter_memory_constraint(
        self, low: float | None = None, high: float | None = None
    ) -> str:
        """Bound parameter memory per device, in bytes (defaults push toward 1/world-size)."""
        return self.sharding_optimizer.add_parameter_memory_constraint(low, high)

    @recorded
    def add_memory_constraint(
        self,
        budget_bytes: float,
        optimizer: str | float = "adamw",
        activation_checkpointing: ActivationCheckpointing = "off",
    ) -> str:
        """Keep the predicted peak memory per device of a whole training step within
        ``budget_bytes``: parameters, gradients, ``optimizer``'s state ("adamw", "adam",
        "sgd", "sgd-momentum" or bytes per parameter element), the activations saved for
        the backward and the gathered parameters (``plan.memory`` itemizes them).

        ``activation_checkpointing="auto"`` lets the solver recompute numbered layers in
        the backward instead of saving their activations, where that is the cheapest way to
        fit; ``plan.recompute`` names them and the parallel module recomputes exactly those.
        "all" recomputes every layer that can be; "off" (the default) keeps every activation.

        Raises InfeasibleConstraintsError when no plan fits, with a lower bound on the
        smallest peak any plan reaches.
        """
        return self.sharding_optimizer.add_memory_constraint(
            budget_bytes, optimizer, activation_checkpointing
        )

    def optimize_placement(self, verbose: bool = False) -> Plan:
        """Solve the problem and return the plan.

        When the mesh spans every rank of a real process group, only the mesh's first rank
        solves and the plan (plain data) is broadcast: every rank applies the very same plan
        (a tie between equally cheap plans can never split the ranks), and the ranks do not
        all run the solver at once. Otherwise (one process, the fake process group, a mesh
        over part of the world) this process solves.

        With a "pp" mesh dim the plan is this rank's stage's, and ``plan.pipeline`` prices
        the whole pipeline: each rank plans its stage and the stages' prices are exchanged
        over the pp group (on a fake mesh this process plans every distinct stage itself).
        Where the microbatches are not fixed, every setting of ``pipeline_settings`` is
        planned (the stage cut and traced again, the user's constraints replayed) and the
        fastest within the memory budget is kept (``plan.pipeline.options`` lists them).
        """
        if self.stage_setup is not None:
            return self._plan_pipeline(verbose)
        return self._solve(verbose)

    def _solve(self, verbose: bool) -> Plan:
        start = time.perf_counter()
        optimizer = self.sharding_optimizer
        if not _shares_plan(self.mesh):
            plan = optimizer.resolve(verbose=verbose)
        else:
            import torch.distributed as dist

            source = int(self.mesh.mesh.flatten()[0])
            shared = [optimizer.resolve(verbose=verbose) if dist.get_rank() == source else None]
            dist.broadcast_object_list(shared, src=source)
            plan = (
                shared[0]
                if dist.get_rank() == source
                else optimizer.adopt(shared[0], verbose=verbose)
            )
        self.stage_times_s["solve"] = time.perf_counter() - start
        return plan

    def save_placements(self, path: str, plan: Plan | None = None) -> None:
        """Write the plan's parameter/input/output placements to a small JSON file."""
        plan = plan or self.sharding_optimizer.get_solution()
        save_placements(plan, self.sharding_optimizer.problem.joint, path)

    @recorded
    def load_placements(self, path: str) -> list[str]:
        """Pin the placements saved by :meth:`save_placements` as constraints (after checking
        the file against this mesh and traced graph); returns the constraint names."""
        optimizer = self.sharding_optimizer
        joint = optimizer.problem.joint
        saved = load_placements(path)
        check_compatible(saved, tuple(self.mesh.shape), joint, path)
        names = self.add_input_constraints(saved.inputs) + self.add_output_constraints(
            saved.outputs
        )
        for name, placements in saved.params.items():
            names.append(
                optimizer.add_placement_constraint(
                    joint.params[name], placements, f"param:{name}", f"parameter {name}"
                )
            )
        return names

    def apply_placement(
        self,
        plan: Plan | None = None,
        collective_timeout: float | timedelta | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
    ) -> nn.Module | ParallelPipeline:
        """The parallel module for ``plan`` (default: the last solution); see runtime/module.py.

        With a "pp" mesh dim: this rank's stage's parallel module inside a
        torch.distributed.pipelining schedule (:class:`ParallelPipeline`, trained with
        ``pipe.step(inputs, target=targets, losses=losses)``), whose last stage calls
        ``loss_fn(output, target)`` per microbatch (required there; see runtime/pipeline.py).

        ``collective_timeout`` (seconds or a timedelta): the longest any later collective on
        the mesh's process groups waits for a peer (``ProcessGroup.set_timeout`` on each; None
        keeps their timeouts, torch's default 30 minutes on gloo). A rank lost in the middle
        of a step then raises ``RankLostError`` on the others within about that time, naming
        it where it can be known (see runtime/faults.py). Collective on a real mesh: every
        rank calls it.
        """
        plan = plan or self.sharding_optimizer.get_solution()
        start = time.perf_counter()
        module = self._parallel_module(plan, collective_timeout)
        if self.stage_setup is None:
            self.stage_times_s["apply"] = time.perf_counter() - start
            return module
        pipeline = plan.pipeline or self.stage_setup.pipeline_plan()
        modules = [module] + [
            other._parallel_module(stage_plan, collective_timeout)
            for other, stage_plan in self._rank_stages(pipeline)
        ]
        self.stage_times_s["apply"] = time.perf_counter() - start
        whole_model = self._whole[0]
        return ParallelPipeline(modules, pipeline, self.stage_setup.pp_mesh, loss_fn, whole_model)

    def _parallel_module(
        self, plan: Plan, collective_timeout: float | timedelta | None
    ) -> nn.Module:
        problem = self.sharding_optimizer.problem
        return apply_placement(
            self.model,
            problem.joint,
            problem.space,
            plan,
            self.mesh,
            dynamic=self.dynamic,
            mp_policy=self.mp_policy,
            collective_timeout=collective_timeout,
        )

    def _rank_stages(self, pipeline: PipelinePlan) -> tuple[tuple[AutoParallel, Plan], ...]:
        """This rank's other stages' planners and plans (several stages per rank)."""
        wanted = len(pipeline.rank_stages) - 1
        held = [(other, plan) for other, plan in self._local_stages if other is not None]
        if len(held) != wanted:
            raise PipelineError(
                f"this rank runs {len(pipeline.rank_stages)} stages "
                f"({', '.join(map(str, pipeline.rank_stages))}) but {len(held) + 1} were "
                "planned: apply the plan optimize_placement returned on this object"
            )
        return tuple(held)

    def _add_boundary_constraints(self, constraints: Sequence, nodes: list, what: str) -> list[str]:
        if not isinstance(constraints, (list, tuple)):
            raise TypeError(
                f"{what} constraints must be a list with one placement tuple per {what} tensor"
            )
        if len(constraints) != len(nodes):
            raise ValueError(
                f"{len(constraints)} {what} constraints given but the model has {len(nodes)} {what} tensor(s); "
                f"give one placement tuple (or None) per {what}"
            )
        mesh_ndim = self.mesh.ndim
        checked = []
        for index, (placements, node) in enumerate(zip(constraints, nodes)):
            if placements is None:
                continue
            label = f"{what} {index}"
            placements = validate_placements(placements, mesh_ndim, label)
            if node is None:
                raise ValueError(
                    f"{label} is not a tensor produced by the graph and cannot be constrained"
                )
            check_shard_dims(placements, node.meta["val"].ndim, label)
            checked.append((index, node, placements, label))
        optimizer = self.sharding_optimizer
        return [
            optimizer.add_placement_constraint(node, p, f"{what}:{i}", label)
            for i, node, p, label in checked
        ]


def _shares_plan(mesh: DeviceMesh) -> bool:
    """Whether one rank solves for all: a real multi-rank group that the mesh spans."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_backend() == "fake":
        return False
    return mesh.size() == dist.get_world_size()


def auto_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    sample_inputs: Any,
    out_shardings: Any,
    *,
    mp_policy: Any = None,
    parameter_memory_budget: tuple[float | None, float | None] | None = None,
    memory_budget: float | None = None,
    optimizer: str | float = "adamw",
    activation_checkpointing: str = "off",
    dynamic: bool = False,
    collective_timeout: float | timedelta | None = None,
    **planner_options: Any,
) -> nn.Module:
    """Plan and apply in one call; returns the parallel module.

    Args:
        sample_inputs: GLOBAL example inputs (a tensor, tuple or dict, or a callable returning
            one). DTensor leaves carry their placements as input constraints; plain tensors
            are taken as replicated.
        out_shardings: a pytree matching the model's outputs, with a placement tuple per
            output tensor.
        parameter_memory_budget: ``(low, high)`` bytes per device for the parameter memory
            constraint (``(None, None)`` = the defaults); ``None`` adds no constraint; any
            other value raises TypeError before anything is traced.
        memory_budget: peak bytes per device of a training step (see
            :meth:`AutoParallel.add_memory_constraint`), with ``optimizer``'s state and
            ``activation_checkpointing`` ("auto": recompute layers where that fits best);
            ``None`` adds no constraint.
        dynamic: accept other input sizes at run time without planning again (see
            :class:`AutoParallel`).
        collective_timeout: seconds (or a timedelta) any collective on the mesh's groups
            waits for a peer; see :meth:`AutoParallel.apply_placement`.
        planner_options: passed to :class:`AutoParallel` (hardware, gpus_per_node, ...).
    """
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import Placement

    from autoparallel._torch_internals import tree_flatten

    if parameter_memory_budget is not None and (
        not isinstance(parameter_memory_budget, (tuple, list)) or len(parameter_memory_budget) != 2
    ):
        raise TypeError(
            "parameter_memory_budget must be a (low, high) pair of byte counts or None, got "
            f"{parameter_memory_budget!r}"
        )
    raw = sample_inputs() if callable(sample_inputs) else sample_inputs
    leaves, spec = tree_flatten(raw)
    placements = [
        tuple(leaf.placements) if isinstance(leaf, DTensor) else (Replicate(),) * mesh.ndim
        for leaf in leaves
    ]

    def input_fn() -> Any:
        import torch

        globals_ = [
            torch.empty(leaf.shape, dtype=leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves
        ]
        return spec.unflatten(globals_)

    def is_placement_tuple(node: Any) -> bool:
        return (
            isinstance(node, (tuple, list))
            and len(node) > 0
            and all(isinstance(p, Placement) for p in node)
        )

    output_placements, _ = tree_flatten(out_shardings, is_leaf=is_placement_tuple)
    with AutoParallel(
        model, input_fn, mesh, mp_policy, dynamic=dynamic, **planner_options
    ) as autop:
        autop.add_input_constraints(placements)
        autop.add_output_constraints(output_placements)
        if parameter_memory_budget is not None:
            autop.add_parameter_memory_constraint(*parameter_memory_budget)
        if memory_budget is not None:
            autop.add_memory_constraint(memory_budget, optimizer, activation_checkpointing)
        plan = autop.optimize_placement()
        return autop.apply_placement(plan, collective_timeout=collective_timeout)
