"""The optimization problem as data: columns, objective, rows and named user constraints.

``problem/build.py`` builds a :class:`Problem` from the earlier stages' outputs;
``problem/constraints.py`` adds the user's constraint families to it; ``solver/highs.py``
solves it. The variables and rows are described in ``problem/build.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from autoparallel.types.costs import CostTables
from autoparallel.types.graph import JointGraph
from autoparallel.types.kinds import ActivationCheckpointing, BucketKind, Phase
from autoparallel.types.memory import MemoryModel
from autoparallel.types.strategies import StrategySpace

MIB = float(1 << 20)


class UnknownNameError(ValueError, KeyError):
    """A name (of a node, a node's input, a constraint) that the problem does not have.

    A ValueError (a bad argument) that is also the KeyError these lookups raised before, so
    callers catching KeyError keep working; its text is the message, not KeyError's repr.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class Folding:
    """Node -> representative; a node that is its own representative is not folded."""

    representative: dict[fx.Node, fx.Node]

    @property
    def num_classes(self) -> int:
        return len(set(self.representative.values()))

    @property
    def num_folded(self) -> int:
        return sum(1 for node, rep in self.representative.items() if node is not rep)


@dataclass
class Row:
    """One linear constraint ``lower <= sum(values * x[columns]) <= upper``.

    ``budget`` marks a resource budget (memory per device) rather than structure: the solver
    may move such a row into the objective at a price per unit (solver/highs.py's priced
    search) and check it on the plan it gets."""

    columns: np.ndarray
    values: np.ndarray
    lower: float
    upper: float
    budget: bool = False

    def merged(self) -> Row:
        """The same row with repeated columns (folded nodes share them) summed into one."""
        columns, inverse = np.unique(self.columns, return_inverse=True)
        values = np.zeros(len(columns))
        np.add.at(values, inverse, self.values)
        return Row(columns, values, self.lower, self.upper, self.budget)


@dataclass(frozen=True)
class EdgeMove:
    """One edge column: it moves the value from ``src`` to ``dst`` placements for ``comm_us``
    (a bucket member's price without the latency its bucket pays)."""

    column: int
    src: object
    dst: object
    comm_us: float


@dataclass(frozen=True)
class AuxiliaryColumns:
    """Columns a constraint adds after the problem's own (``Problem.num_variables`` of
    them), e.g. how many layers the memory constraint recomputes. Column ``i`` here is
    column ``num_variables + i`` in the constraint's rows; at most one constraint of a
    problem has them."""

    names: tuple[str, ...]
    objective: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integral: np.ndarray  # bool per column

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class UserConstraint:
    """A named constraint the user asked for; ``rows`` are added to the structural ones,
    ``columns`` (if any) to the problem's columns."""

    name: str
    description: str
    rows: list[Row]
    columns: AuxiliaryColumns | None = None


@dataclass(frozen=True)
class BucketMember:
    """A pair of an edge that joins a bucket when chosen: it moves in one step (no route),
    priced without the collective's latency plus its share of the bucket's."""

    edge: int  # index into tables.edges
    pair: int  # index into that edge's pairs
    saving_us: float  # the pair's price minus the step's price without the latency
    share_us: float  # its part of the bucket's latency, added back (see problem/buckets.py)


@dataclass(frozen=True)
class Bucket:
    """Collectives the runtime issues as one: gradient reductions of one (mesh dim, target,
    dtype), or one layer's parameter all-gathers of one (phase, mesh dim, dtype).

    ``candidates`` is how many edges could join it; each member pair carries
    ``latency_us / candidates`` of the latency in the objective, or ``latency_us / used``
    once a plan used only ``used`` of them (see problem/buckets.py).
    """

    kind: BucketKind
    description: str  # e.g. "all_reduce over mesh dim 0 to R, float32"
    latency_us: float
    candidates: int
    members: tuple[BucketMember, ...]


@dataclass(frozen=True)
class OverlapWindow:
    """Communication the runtime runs on the collective threads while some compute runs on
    the host: the comm of ``comm_edges`` (every move on them, ``comm_row`` in the edge
    columns, a bucket's latency left out) hides behind the compute of ``compute_nodes``, up
    to the hardware's overlap fraction of the smaller of the two (see problem/overlap.py)."""

    phase: Phase
    comm: str  # what hides, e.g. "parameter gathers of layers.3"
    during: str  # behind what, e.g. "forward of layers.2"
    compute_nodes: tuple[fx.Node, ...]
    comm_edges: tuple[int, ...]  # indices into tables.edges
    comm_row: Row  # sum of comm_us * column over the edges' moves


@dataclass
class Problem:
    joint: JointGraph
    space: StrategySpace
    tables: CostTables
    node_columns: dict[fx.Node, np.ndarray]
    edge_columns: list[np.ndarray]
    objective: np.ndarray
    integrality: np.ndarray
    rows: list[Row]
    folding: Folding | None = None
    user_constraints: dict[str, UserConstraint] = field(default_factory=dict)
    # per edge: "pairs" (edge_columns[e][k] is edge.pairs[k]) or "routes" (edge_columns[e][k]
    # is arc k of edge.routes.table); empty means all pairs
    edge_encodings: list[str] = field(default_factory=list)
    # collectives the runtime coalesces, priced one latency per bucket (problem/buckets.py)
    buckets: list[Bucket] = field(default_factory=list)
    # communication priced as hidden behind compute (problem/overlap.py); fraction 0: none.
    # overlap_shares[w]: the part of window w's comm the objective takes off
    overlap_windows: list[OverlapWindow] = field(default_factory=list)
    overlap_shares: list[float] = field(default_factory=list)
    overlap_fraction: float = 0.0
    # bytes per device of a step (problem/memory.py), built on first use for
    # ``memory_optimizer``'s state; the memory constraint's budget once one is added
    memory: MemoryModel | None = None
    memory_optimizer: str | float = "adamw"
    memory_budget: float | None = None
    # "auto": the memory constraint may recompute layers (problem/recompute.py)
    activation_checkpointing: ActivationCheckpointing = "off"
    # microbatches whose saved activations are alive at once (a pipeline stage's in flight
    # under its schedule, stage_setup.py); the memory model counts each
    activation_copies: int = 1
    # (edge, pair) -> objective saving of each bucket member, indexed by set_buckets
    _savings: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)
    _shares: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)
    _bucket_edges: set[int] = field(default_factory=set, repr=False)

    def set_buckets(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self._savings = {
            (m.edge, m.pair): m.saving_us - m.share_us for b in buckets for m in b.members
        }
        self._shares = {(m.edge, m.pair): m.share_us for b in buckets for m in b.members}
        self._bucket_edges = {m.edge for b in buckets for m in b.members}

    def pair_saving(self, edge: int, pair: int) -> float:
        """How far below its route's price pair ``pair`` of edge ``edge`` is in the objective,
        as a bucket member (its latency taken off, its share of the bucket's added)."""
        return self._savings.get((edge, pair), 0.0)

    def edge_encoding(self, index: int) -> str:
        return self.edge_encodings[index] if self.edge_encodings else "pairs"

    def edge_moves(self, index: int) -> list[EdgeMove]:
        """What each column of edge ``index`` moves: a placement pair or one route step."""
        edge, columns = self.tables.edges[index], self.edge_columns[index]
        if self.edge_encoding(index) == "pairs":
            return [
                EdgeMove(
                    int(column),
                    edge.src_options[i],
                    edge.dst_options[j],
                    comm - self.pair_saving(index, k),
                )
                for k, (column, (i, j, comm, _)) in enumerate(zip(columns, edge.pairs))
            ]
        assert edge.routes is not None
        pricer, table = edge.routes.pricer, edge.routes.table
        return [
            EdgeMove(
                int(column),
                pricer.placements_of_state(int(a)),
                pricer.placements_of_state(int(b)),
                float(comm),
            )
            for column, a, b, comm in zip(columns, table.arc_src, table.arc_dst, table.arc_comm)
        ]

    def bucket_share(self, edge: int, pair: int) -> float:
        """The share of its bucket's latency that pair ``pair`` of edge ``edge`` carries in
        the objective (0 for a pair in no bucket)."""
        return self._shares.get((edge, pair), 0.0)

    def chosen_pair(self, index: int, choice: dict[fx.Node, int]) -> tuple[int, int]:
        """(src option, dst option) edge ``index`` takes under the strategies of ``choice``."""
        edge = self.tables.edges[index]
        return (
            edge.src_of_strategy[choice[edge.producer]],
            edge.dst_of_strategy[choice[edge.consumer]],
        )

    def chosen_comm_us(self, index: int, choice: dict[fx.Node, int]) -> float:
        """The comm of edge ``index`` under ``choice``, a bucket member's without the bucket's
        latency (its cheapest route's price otherwise)."""
        edge = self.tables.edges[index]
        src, dst = self.chosen_pair(index, choice)
        if edge.routes is not None:
            comm = edge.routes.table.price(
                edge.routes.src_states[src], edge.routes.dst_states[dst]
            )[0]
        else:
            comm = next((c for i, j, c, _ in edge.pairs if (i, j) == (src, dst)), 0.0)
        pair = self.pair_index(index, src, dst) if index in self._bucket_edges else None
        if pair is not None:
            comm -= self.pair_saving(index, pair) + self.bucket_share(index, pair)
        return float(comm)

    def pair_index(self, index: int, src: int, dst: int) -> int | None:
        """Position of the pair (src, dst) in edge ``index``'s pairs, None if infeasible."""
        for k, (i, j, _, _) in enumerate(self.tables.edges[index].pairs):
            if i == src and j == dst:
                return k
        return None

    @property
    def num_variables(self) -> int:
        return len(self.objective)

    @property
    def num_constraints(self) -> int:
        return len(self.rows) + sum(len(c.rows) for c in self.user_constraints.values())

    # ------------------------------------------------------------------ user constraints

    def add_constraint(self, constraint: UserConstraint) -> str:
        if constraint.name in self.user_constraints:
            raise ValueError(f"a constraint named {constraint.name!r} already exists")
        if constraint.columns is not None and self.auxiliary_owner() is not None:
            raise ValueError(
                f"constraint {constraint.name!r} adds columns, and so does "
                f"{self.auxiliary_owner()!r}: remove that one first"
            )
        self.user_constraints[constraint.name] = constraint
        return constraint.name

    def auxiliary_owner(self) -> str | None:
        """The user constraint that adds columns, if any (see AuxiliaryColumns)."""
        return next((n for n, c in self.user_constraints.items() if c.columns is not None), None)

    def remove_constraints(self, names: Iterable[str]) -> list[str]:
        """Remove the named user constraints and return their names: TypeError for a bare
        string or anything else that is not a collection of names, UnknownNameError naming
        any that do not exist (then nothing is removed)."""
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise TypeError(
                f"remove_constraints takes a list of constraint names, got {names!r}"
                + (f"; write remove_constraints([{names!r}])" if isinstance(names, str) else "")
            )
        names = list(names)
        unknown = [n for n in names if n not in self.user_constraints]
        if unknown:
            raise UnknownNameError(
                f"no such constraints: {unknown}; existing: {sorted(self.user_constraints)}"
            )
        for name in names:
            del self.user_constraints[name]
        return names
