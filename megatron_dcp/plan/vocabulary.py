"""The bounded vocabulary of rank groups the planner may use and the runtime's pool creates.

Every contiguous window of every size would be about N^2/2 groups (65k at 1,024 ranks), each an
NCCL communicator with its creation time and memory. The vocabulary keeps:

* inside a node: aligned blocks of 1, 2, 4, ... ranks (powers of two up to the node size), the node
  itself, and the odd sizes 3 and 6 (aligned at multiples of their size) where they fit a node:
  they let a sequence that is just too long for 2 (or 4) ranks use 3 (or 6) instead of 4 (or 8);
* across nodes: k whole nodes aligned at multiples of k, for k a power of two or 3 x a power of two,
  and the whole DCP world.

A task on a group also uses the Ulysses and ring sub-groups of its layout (`communicators`), so
the vocabulary also fixes which Ulysses degrees each group size may use (`ulysses_degrees`, called
by the cost model when it chooses a layout and by the pool when it creates communicators).
``ulysses_scope="node"`` keeps Ulysses inside a node: a group spanning nodes runs either pure ring
or the largest Ulysses degree inside a node with ring across nodes, which cuts the communicators a
rank holds (`communicators_per_rank`).

`megatron_dcp.plan.planners.vocabulary_for_lengths` keeps only the group sizes the job's length
distribution needs (``sizes=``): fewer communicators, the same placements for the sizes kept.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Sequence

from megatron_dcp.config import ULYSSES_SCOPES

ODD_SIZES = (3, 6)
LENGTH_SAMPLE = 2048
"""Distinct lengths `vocabulary_for_lengths` (planners.py) looks at (more are thinned to
quantiles)."""


def _nice(k: int) -> bool:
    """A power of two or three times a power of two."""
    while k % 2 == 0:
        k //= 2
    return k in (1, 3)


def ulysses_degrees(size: int, ranks_per_node: int, *, heads: Optional[int] = None,
                    attention_layout: str = "auto", ulysses_scope: str = "any") -> tuple[int, ...]:
    """Ulysses degrees a task on an aligned vocabulary group of ``size`` ranks may use.

    ``heads``: the number every Ulysses degree must divide (the gcd of query and key/value heads
    per tensor-parallel rank); ``None``: any divisor of ``size``. ``attention_layout``: auto,
    ulysses (the whole group where allowed), ring (degree 1), hybrid (below the whole group where
    possible). ``ulysses_scope="node"``: a group spanning nodes keeps degree 1 (pure ring: no
    sub-group) and the largest allowed degree dividing ``ranks_per_node`` (Ulysses inside a node,
    ring across): each further degree would add its own strided ring sub-groups.
    """
    if ulysses_scope not in ULYSSES_SCOPES:
        raise ValueError(f"ulysses_scope={ulysses_scope!r}: must be one of {ULYSSES_SCOPES}")
    ok = [u for u in range(1, size + 1) if size % u == 0 and (heads is None or heads % u == 0)]
    if ulysses_scope == "node" and size > ranks_per_node:
        inside = [u for u in ok if ranks_per_node % u == 0]
        ok = sorted({1, max(inside)})
    if attention_layout == "ring":
        return (1,)
    if attention_layout == "ulysses" and size in ok:
        return (size,)
    if attention_layout == "hybrid" and size > 1:
        return tuple(u for u in ok if u < size) or tuple(ok)
    return tuple(ok)


ALL_REDUCE, ALL_TO_ALL, SEND_RECV = "all_reduce", "all_to_all", "send_recv"
"""The kinds of collective a task runs on its communicators: an all-reduce over the whole task
group (MoE's sequence-level balancing loss sums expert counts there), Ulysses' all-to-all, and
the ring's send to the next member with a receive from the previous one."""


def operations(ranks: Sequence[int], ulysses: int,
               all_reduce: bool = False) -> dict[tuple[int, ...], frozenset[str]]:
    """The collectives a task on ``ranks`` with Ulysses degree ``ulysses`` runs on each of its
    communicators (`communicators`, in that order): the whole group runs all-to-all at degree
    ``len(ranks)`` and send/receive at degree 1 (and the all-reduce where ``all_reduce``); its
    Ulysses sub-groups run all-to-all, its ring sub-groups send/receive."""
    ranks = tuple(int(r) for r in ranks)
    d = len(ranks)
    if ulysses < 1 or d % ulysses:
        raise ValueError(f"Ulysses degree {ulysses} does not divide the group {ranks}")
    out: dict[tuple[int, ...], frozenset[str]] = {}
    if d > 1:
        whole = {ALL_TO_ALL} if ulysses == d else {SEND_RECV} if ulysses == 1 else set()
        out[ranks] = frozenset(whole | ({ALL_REDUCE} if all_reduce else set()))
    if 1 < ulysses < d:  # at 1 or d one sub-group kind is the group itself, the other single ranks
        out.update((ranks[j:j + ulysses], frozenset({ALL_TO_ALL})) for j in range(0, d, ulysses))
        out.update((ranks[i::ulysses], frozenset({SEND_RECV})) for i in range(ulysses))
    return out


def communicators(ranks: Sequence[int], ulysses: int) -> list[tuple[int, ...]]:
    """Every multi-rank process group a task on ``ranks`` with Ulysses degree ``ulysses`` uses:
    the group, its Ulysses sub-groups (contiguous slices of ``ranks``) and its ring sub-groups
    (strided: ``ranks[i::ulysses]``), following the layout convention of `megatron_dcp.plan.plan`.
    """
    return list(operations(ranks, ulysses))


NET_CONNECTION_SHARE = 2 / 32
"""The memory of a send/receive connection to a peer on another node, as a share of one inside
a node: NCCL gives a network peer 2 channels (``NCCL_NCHANNELS_PER_NET_PEER``), an NVLink peer
up to 32 (NCCL issue #1685)."""


def member_connections(group: Sequence[int], kinds: Iterable[str],
                       ranks_per_node: int) -> Iterator[tuple[int, float]]:
    """``(rank, connections)`` for each member of ``group``: the NCCL send/receive connections
    (a peer in one direction) the collective ``kinds`` set up there, one to a peer on another
    node counted as `NET_CONNECTION_SHARE`. All-to-all connects every other member both ways;
    the ring sends to the next member and receives from the previous one (a subset of those)."""
    kinds, n = set(kinds), len(group)
    node = [r // ranks_per_node for r in group]
    on_node = Counter(node)  # one pass (a count per node was quadratic in big groups)
    for i, r in enumerate(group):
        if ALL_TO_ALL in kinds:  # every other member, both ways
            near = on_node[node[i]] - 1
            yield r, 2 * (near + (n - 1 - near) * NET_CONNECTION_SHARE)
        elif SEND_RECV in kinds:  # a send to the next member, a receive from the previous one
            yield r, sum(1.0 if node[j] == node[i] else NET_CONNECTION_SHARE
                         for j in ((i + 1) % n, (i - 1) % n))
        else:
            yield r, 0.0


@dataclasses.dataclass(frozen=True)
class Communicators:
    """The communicators of a group vocabulary one rank holds at most, and the device memory the
    planner charges a rank for them (the most over ranks; `Vocabulary.charge`)."""

    per_rank: int
    bytes: float


def _most_per_rank(groups: Iterable[Sequence[int]], world_size: int) -> int:
    """Most groups any one rank belongs to."""
    count = [0] * world_size
    for g in groups:
        for r in g:
            count[r] += 1
    return max(count)


class VocabularyRules(NamedTuple):
    """What decides a vocabulary's groups and layouts, its kept sizes aside (`Vocabulary.rules`)."""

    world_size: int
    ranks_per_node: int
    max_degree: Optional[int]
    heads: Optional[int]
    attention_layout: str
    ulysses_scope: str


@functools.lru_cache(maxsize=16)
def _communicators_of(rules: VocabularyRules, kept: Optional[tuple[int, ...]],
                      all_reduce: bool = False) -> dict[tuple[int, ...], frozenset[str]]:
    """Every communicator of a vocabulary of these rules and kept sizes, in
    `Vocabulary.communicators`' order, with the collectives its tasks run on it (`operations`;
    ``all_reduce``: tasks all-reduce over their whole group)."""
    vocab = Vocabulary(rules.world_size, rules.ranks_per_node, rules.max_degree,
                       heads=rules.heads, attention_layout=rules.attention_layout,
                       ulysses_scope=rules.ulysses_scope, sizes=kept)
    found: dict[tuple[int, ...], frozenset[str]] = {}
    for ranks in vocab.groups():
        for u in vocab.ulysses_degrees(len(ranks)):
            for group, kinds in operations(ranks, u, all_reduce).items():
                found[group] = found.get(group, frozenset()) | kinds
    return {g: found[g] for g in sorted(found, key=lambda g: (len(g), g))}


@functools.lru_cache(maxsize=16)
def _charge_of(rules: VocabularyRules, kept: Optional[tuple[int, ...]], all_reduce: bool,
               communicator_bytes: float, connection_bytes: Optional[float]) -> Communicators:
    """`Vocabulary.charge` (cached: the planner builds a cost model, hence asks for it, on
    every call; at 1,024 ranks it takes tens of ms)."""
    found = _communicators_of(rules, kept, all_reduce)
    world, ranks_per_node = rules.world_size, min(rules.ranks_per_node, rules.world_size)
    held, charged = [0] * world, [0.0] * world
    for group, kinds in found.items():
        for r in group:
            held[r] += 1
            charged[r] += communicator_bytes * (connection_bytes is None or ALL_REDUCE in kinds)
        if connection_bytes is not None:  # what the collectives it runs set up
            for r, count in member_connections(group, kinds, ranks_per_node):
                charged[r] += connection_bytes * count
    return Communicators(max(held), max(charged))


class Vocabulary:
    """Allowed groups of a DCP world of ``world_size`` ranks, ``ranks_per_node`` per node, and the
    Ulysses degrees (hence sub-groups) each group size may use (see `ulysses_degrees` for
    ``heads``, ``attention_layout`` and ``ulysses_scope``). ``sizes``: keep only groups of these
    sizes (`megatron_dcp.plan.planners.vocabulary_for_lengths`); ``None``: every size of the rule
    above."""

    def __init__(self, world_size: int, ranks_per_node: int, max_degree: Optional[int] = None,
                 *, heads: Optional[int] = None, attention_layout: str = "auto",
                 ulysses_scope: str = "any", sizes: Optional[Iterable[int]] = None,
                 task_all_reduce: bool = False) -> None:
        if world_size < 1 or ranks_per_node < 1:
            raise ValueError(f"world_size={world_size} and ranks_per_node={ranks_per_node} must "
                             "be >= 1")
        if ulysses_scope not in ULYSSES_SCOPES:
            raise ValueError(f"ulysses_scope={ulysses_scope!r}: must be one of {ULYSSES_SCOPES}")
        self.world_size = world_size
        self.ranks_per_node = rpn = min(ranks_per_node, world_size)
        self.heads = heads
        self.attention_layout = attention_layout
        self.ulysses_scope = ulysses_scope
        self.max_degree = max_degree
        self.task_all_reduce = bool(task_all_reduce)
        """Tasks all-reduce over their whole group (MoE's sequence-level balancing loss): those
        groups are warmed and charged for it (`operations`, `charge`)."""
        cap = max_degree or world_size
        groups: dict[int, list[int]] = {}

        def add(first: int, size: int) -> None:
            if size <= cap and first + size <= world_size:
                firsts = groups.setdefault(size, [])
                if not firsts or firsts[-1] != first:
                    firsts.append(first)

        intra = sorted({s for s in range(1, rpn + 1)
                        if (s & (s - 1)) == 0 or s == rpn or s in ODD_SIZES})
        for node_start in range(0, world_size, rpn):
            node_size = min(rpn, world_size - node_start)
            for s in intra:
                for off in range(0, node_size - s + 1, s):
                    add(node_start + off, s)
        nodes = world_size // rpn
        for k in range(2, nodes + 1):
            if _nice(k) or k == nodes:
                for j in range(0, nodes - k + 1, k):
                    add(j * rpn, k * rpn)
        add(0, world_size)
        self.kept = None if sizes is None else tuple(sorted({int(k) for k in sizes}))
        """The ``sizes`` this vocabulary was restricted to (``None``: not restricted)."""
        self._first_ranks = {s: tuple(v) for s, v in sorted(groups.items())
                        if self.kept is None or s in self.kept}
        self.sizes: tuple[int, ...] = tuple(self._first_ranks)

    @classmethod
    def for_cost_model(cls, cost_model: Any, max_degree: Optional[int] = None) -> "Vocabulary":
        """The vocabulary `megatron_dcp.plan.make_plan` plans over with ``cost_model`` (its world,
        ranks per node, heads, attention layout and Ulysses scope): what a pool built at start-up
        must hold so that the planner's plans create no group inside the step."""
        m = cost_model.model
        # a Ulysses degree must divide both the query and the key/value heads
        heads = math.gcd(m.heads_per_rank, m.kv_heads_per_rank)
        return cls(cost_model.world_size, cost_model.ranks_per_node, max_degree, heads=heads,
                   attention_layout=cost_model.attention_layout,
                   ulysses_scope=getattr(cost_model, "ulysses_scope", "any"),
                   task_all_reduce=bool(m.num_experts))

    def first_ranks(self, size: int) -> tuple[int, ...]:
        """First ranks of groups of ``size`` ranks, ascending (empty: the size is not in the
        vocabulary)."""
        return self._first_ranks.get(size, ())

    def groups(self) -> Iterator[tuple[int, ...]]:
        """Every task group as a tuple of ranks."""
        for size, firsts in self._first_ranks.items():
            for first in firsts:
                yield tuple(range(first, first + size))

    def __len__(self) -> int:
        return sum(len(v) for v in self._first_ranks.values())

    def __contains__(self, ranks: tuple[int, ...]) -> bool:
        if not ranks:
            return False
        start, size = ranks[0], len(ranks)
        return tuple(ranks) == tuple(range(start, start + size)) \
            and start in self._first_ranks.get(size, ())

    def ulysses_degrees(self, size: int) -> tuple[int, ...]:
        """Ulysses degrees a task on a group of ``size`` ranks may use (`ulysses_degrees`)."""
        return ulysses_degrees(size, self.ranks_per_node, heads=self.heads,
                               attention_layout=self.attention_layout,
                               ulysses_scope=self.ulysses_scope)

    def communicators(self) -> tuple[tuple[int, ...], ...]:
        """Every multi-rank process group a plan over this vocabulary can use (task groups and
        the sub-groups of every allowed Ulysses degree), in one fixed order: size, then ranks."""
        return tuple(_communicators_of(self.rules(), self.kept, False))

    def operations(self) -> dict[tuple[int, ...], frozenset[str]]:
        """`communicators` with the collectives tasks run on each (`operations`): what the pool
        warms each with at start-up."""
        return dict(_communicators_of(self.rules(), self.kept, self.task_all_reduce))

    def communicators_per_rank(self) -> int:
        """Most communicators (process groups of two or more ranks) any one rank belongs to."""
        return self.charge(0.0).per_rank

    def charge(self, communicator_bytes: float,
               connection_bytes: Optional[float] = None) -> Communicators:
        """The communicators a rank holds at most and their device memory: each charged
        ``communicator_bytes`` where its tasks all-reduce over it and ``connection_bytes`` per
        send/receive connection its collectives set up (`member_connections`); with
        ``connection_bytes`` ``None``, ``communicator_bytes`` each whatever it runs. The most
        over ranks (`megatron_dcp.plan.hardware.Hardware.connection_bytes`)."""
        return _charge_of(self.rules(), self.kept, self.task_all_reduce,
                          float(communicator_bytes),
                          None if connection_bytes is None else float(connection_bytes))

    def rules(self) -> VocabularyRules:
        """What decides the groups and layouts, the kept sizes aside."""
        return VocabularyRules(self.world_size, self.ranks_per_node, self.max_degree, self.heads,
                               self.attention_layout, self.ulysses_scope)

    def max_groups_per_rank(self) -> int:
        """Most task groups any one rank belongs to (sub-groups not counted)."""
        return _most_per_rank(self.groups(), self.world_size)

    def describe(self) -> str:
        """One line: group count per size, communicators in all and per rank."""
        parts = ", ".join(f"{s}x{len(v)}" for s, v in self._first_ranks.items())
        return (f"{len(self)} groups ({parts}); at most {self.max_groups_per_rank()} per rank; "
                f"{len(self.communicators())} communicators with sub-groups, at most "
                f"{self.communicators_per_rank()} per rank")
