"""Drafts and their timing, shared by every planner: the planning context (`PlanContext`), draft
tasks (`Draft`), a planning pass's plan (`Candidate`), rank availability (`BlockClock`; in a
lockstep slot `Occupancy`), re-timing, a free schedule in lockstep (`to_slots`), DCP-intra on a
finished structure (`lighten`) and the conversion to a `Plan`."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Sequence

from megatron_dcp.plan.cost import CostModel, Layout
from megatron_dcp.plan.plan import Plan, PlanError, Task
from megatron_dcp.plan.vocabulary import Vocabulary


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up (integers)."""
    return -(-a // b)


@dataclass
class Draft:
    """A task before it becomes a `Task`: contiguous ranks ``[start_rank, start_rank + degree)``."""

    start_rank: int
    degree: int
    seqs: list[int]
    recompute_layers: int
    layout: Layout
    duration: float
    release: float = 0.0
    """Earliest start (a lockstep baseline's round barrier); 0 for free-running plans."""
    tokens: int = 0
    """Tokens of ``seqs`` before padding."""
    pairs: float = 0.0
    """Attention pairs of ``seqs``."""
    start: float = 0.0
    slot: Optional[int] = None
    """Lockstep slot; ``None`` in a free schedule."""


class Candidate(NamedTuple):
    """One planning pass's plan: its predicted makespan, its name and its timed drafts."""

    makespan: float
    name: str
    drafts: list[Draft]


@dataclass
class PlanContext:
    """Everything a planner needs for one global batch."""

    lengths: list[int]
    active: list[int]
    """Sequences to plan (skipped ones are left out)."""
    cm: CostModel
    vocab: Vocabulary
    recompute_mode: str
    """auto, none or full (from DCPConfig.recompute)."""
    pack_tokens: Optional[int] = None
    baseline_degree: "str | int" = "tuned"
    """Fixed degree of the baselines: tuned (fastest power of two at which the longest sequence
    fits), min (the smallest such degree, the paper's literal bucket setting) or a group size."""
    pairs: list[float] = field(default_factory=list)
    frame_tokens: Optional[list[int]] = None
    """Tokens per frame of every sequence (videos of mixed resolution, `Plan.frame_tokens`);
    ``None``: the model's."""

    def __post_init__(self) -> None:
        cm = self.cm
        self._layers = cm.model.num_layers
        # most local tokens per rank without / with full recompute (memory_of == budget)
        self._local0 = cm.memory_model.max_local_tokens(0)
        self._local_full = cm.memory_model.max_local_tokens(self._layers)
        if not self.pairs:
            frames = self.frame_tokens or [None] * len(self.lengths)
            self.pairs = [self.cm.pairs_of(n, s) for n, s in zip(self.lengths, frames)]
        self.padded = cm.padded
        """Tokens of one sequence on a degree after padding (`CostModel.padded`; bound once:
        the planner's inner loops call it hundreds of thousands of times)."""
        self._times: dict[tuple[int, float, int, int], tuple[float, Layout]] = {}
        self._fitting: dict[tuple[int, str], tuple[tuple[int, int], ...]] = {}
        self._pads = [(d, cm.pad_multiple(d)) for d in self.vocab.sizes]
        """(size, padding multiple) of every vocabulary size (`fitting_options`' inner loop)."""
        # the longest sequence that fits every size without recompute / with every layer
        # recomputed (padded to m on d ranks: ceil(n / m) * m <= d * local), and those fits
        fits = {"auto": (self._local0, 0), "none": (self._local0, 0),
                "full": (self._local_full, self._layers)}  # mode -> (local tokens, layers)
        self._short = {
            mode: (min(((d * local // m) * m for d, m in self._pads), default=0),
                   tuple((d, layers) for d, _ in self._pads))
            for mode, (local, layers) in fits.items()}

    @property
    def world(self) -> int:
        """Ranks of the DCP world."""
        return self.vocab.world_size

    def padded_tokens(self, seqs: Sequence[int], degree: int) -> int:
        """Tokens of a task over ``seqs`` on ``degree`` ranks after padding."""
        lengths, padded = self.lengths, self.cm.padded
        return sum(padded(lengths[s], degree) for s in seqs)

    def recompute_for(self, padded_tokens: int, degree: int, mode: str) -> Optional[int]:
        """Recomputed layers of a task under the recompute ``mode`` (`DCPConfig.recompute`: auto,
        the fewest that fit; full; none); ``None``: does not fit."""
        local = ceil_div(padded_tokens, degree)
        if mode == "none":
            return 0 if local <= self._local0 else None
        if mode == "full":
            return self._layers if local <= self._local_full else None
        if local <= self._local0:
            return 0
        if local > self._local_full:
            return None
        return self.cm.memory_model.min_recompute_layers(padded_tokens, degree)

    def seq_time(self, length: int, pairs: float, degree: int, recompute_layers: int) -> float:
        """`TimeModel.best_time` of one sequence (or task) of ``length`` tokens and ``pairs``,
        cached: the passes ask for the same (length, degree, recomputed layers) many times."""
        return self.seq_best(length, pairs, degree, recompute_layers)[0]

    def seq_best(self, length: int, pairs: float, degree: int, recompute_layers: int
                 ) -> tuple[float, Layout]:
        """`TimeModel.best_time` (time and layout), cached as `seq_time` (a draft of a task
        timed before reads its layout here)."""
        key = (length, pairs, degree, recompute_layers)
        found = self._times.get(key)
        if found is None:
            found = self._times[key] = self.cm.time_model.best_time(length, pairs, degree,
                                                                    recompute_layers)
        return found

    def fitting_options(self, length: int, mode: str) -> tuple[tuple[int, int], ...]:
        """(degree, recomputed layers under ``mode``) of every vocabulary size where a sequence
        of ``length`` tokens fits, smallest first (cached per length and mode)."""
        short = self._short.get(mode)
        if short is not None and length <= short[0]:
            return short[1]
        key = (length, mode)
        found = self._fitting.get(key)
        if found is None:
            if mode == "full":
                found = tuple((d, self._layers) for d, m in self._pads
                              if ceil_div(ceil_div(length, m) * m, d) <= self._local_full)
            else:
                found = []
                for d, m in self._pads:
                    padded = ceil_div(length, m) * m  # `CostModel.padded`
                    if ceil_div(padded, d) <= self._local0:
                        found.append((d, 0))  # no recompute
                        continue
                    c = self.recompute_for(padded, d, mode)
                    if c is not None:
                        found.append((d, c))
                found = tuple(found)
            self._fitting[key] = found
        return found

    def baseline_mode(self) -> str:
        """A baseline's recompute mode: full unless the config says none."""
        return "none" if self.recompute_mode == "none" else "full"

    def draft(self, start_rank: int, degree: int, seqs: list[int], recompute_layers: int,
              release: float = 0.0, layout: Optional[Layout] = None,
              sums: Optional[tuple[int, float]] = None) -> Draft:
        """A draft task with its best layout and predicted duration. ``sums``: the tokens and
        attention pairs of ``seqs``, where the caller has them."""
        if sums is None:
            sums = (sum(self.lengths[s] for s in seqs), sum(self.pairs[s] for s in seqs))
        tokens, pairs = sums
        if layout is None:
            duration, layout = self.seq_best(tokens, pairs, degree, recompute_layers)
        else:
            duration = self.cm.time_model.time_of(tokens, pairs, layout, recompute_layers)
        return Draft(start_rank, degree, list(seqs), recompute_layers, layout, duration, release,
                     tokens, pairs)


def retime(drafts: Sequence[Draft], world: int, barriers: "bool | str" = True) -> float:
    """Set every draft's start: in list order, when all its ranks are free. ``barriers=True``: not
    before its release; ``"rounds"``: drafts with equal release form a lockstep round that starts
    when the previous round has ended (releases are recomputed); ``False``: no barriers.
    Returns the makespan."""
    avail = [0.0] * world
    end_max = 0.0
    round_key = None
    round_start = 0.0
    for d in drafts:
        if barriers == "rounds" and d.release != round_key:
            round_key = d.release
            round_start = end_max
        a, b = d.start_rank, d.start_rank + d.degree
        start = max(avail[a:b]) if b - a > 1 else avail[a]
        if barriers == "rounds":
            start = max(start, round_start)
        elif barriers and d.release > start:
            start = d.release
        d.start = start
        end = start + d.duration
        for r in range(a, b):
            avail[r] = end
        if end > end_max:
            end_max = end
    if barriers == "rounds":
        for d in drafts:
            d.release = d.start if d.release else 0.0
    return end_max


def retime_slots(drafts: Sequence[Draft], cm: CostModel) -> float:
    """Start times of a lockstep schedule: slot ``k`` starts when slot ``k - 1`` has ended and
    lasts the longer of its longest task and `TimeModel.slot_time` (every rank runs a micro-step
    in every slot; `TimeModel.slot_durations`). Every draft needs a slot. Returns the makespan
    (the simulator's rule too)."""
    recompute_layers = [0] * (max((d.slot for d in drafts), default=-1) + 1)
    for d in drafts:
        recompute_layers[d.slot] = d.recompute_layers
    durations = cm.time_model.slot_durations(recompute_layers,
                                             ((d.slot, d.duration) for d in drafts))
    starts = list(itertools.accumulate(durations, initial=0.0))
    for d in drafts:
        d.start = starts[d.slot]
    return starts[-1]


def to_slots(pctx: PlanContext, drafts: Sequence[Draft]) -> list[Draft]:
    """A free schedule in lockstep: each task in the first slot after its ranks' previous tasks
    (its own order kept), every task of a slot at the slot's deepest recompute. Timed."""
    order = sorted(drafts, key=lambda d: (d.start, d.start_rank))
    next_slot = [0] * pctx.world
    placed = []
    for d in order:
        ranks = range(d.start_rank, d.start_rank + d.degree)
        k = max(next_slot[r] for r in ranks)
        for r in ranks:
            next_slot[r] = k + 1
        placed.append((k, d))
    recompute_layers: dict[int, int] = {}
    for k, d in placed:
        recompute_layers[k] = max(recompute_layers.get(k, 0), d.recompute_layers)
    out = []
    for k, d in placed:
        new = pctx.draft(d.start_rank, d.degree, d.seqs, recompute_layers[k], layout=d.layout) \
            if d.recompute_layers != recompute_layers[k] else replace(d)
        new.slot = k
        out.append(new)
    retime_slots(out, pctx.cm)
    return out


class Occupancy:
    """The ranks of one slot that have a task; answers "the first free vocabulary group of size
    d" (`first_free`)."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self.busy = bytearray(vocab.world_size)
        self.free = vocab.world_size
        """Ranks without a task."""
        self._widest = len(vocab.sizes) - 1
        """Index into ``vocab.sizes`` above which no size has a free group."""
        self._first: dict[int, int] = {}
        """Per size, the index into ``vocab.first_ranks(size)`` before which every group has a busy
        rank (ranks only get busier: the scan resumes there)."""

    def first_free(self, size: int) -> Optional[int]:
        """The first rank of the first vocabulary group of ``size`` ranks without a busy rank
        (``None``: there is none)."""
        starts, busy = self.vocab.first_ranks(size), self.busy
        k = self._first.get(size, 0)
        while k < len(starts) and busy.find(1, starts[k], starts[k] + size) >= 0:
            k += 1
        self._first[size] = k
        return starts[k] if k < len(starts) else None

    def widest_free(self) -> int:
        """The widest vocabulary size of which a group is free (0: none)."""
        sizes = self.vocab.sizes
        while self._widest >= 0 and self.first_free(sizes[self._widest]) is None:
            self._widest -= 1  # ranks only get busier: a size without a free group stays so
        return sizes[self._widest] if self._widest >= 0 else 0

    def take(self, start: int, size: int) -> None:
        """Ranks ``[start, start + size)`` get a task."""
        self.busy[start:start + size] = b"\x01" * size
        self.free -= size

    def free_ranks(self) -> list[int]:
        """The ranks without a task."""
        return [r for r, b in enumerate(self.busy) if not b]


class BlockClock:
    """Rank availability with, per group size, a lazy heap of blocks keyed by their free time."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self.avail = [0.0] * vocab.world_size
        self.heaps: dict[int, list[tuple[float, int]]] = {}

    def peek(self, size: int) -> tuple[int, float]:
        """The group of ``size`` ranks that frees first: (start rank, when all of it is free)."""
        heap = self.heaps.get(size)
        if heap is None:
            heap = [(0.0, s) for s in self.vocab.first_ranks(size)]
            if not heap:
                raise PlanError(f"no group of {size} ranks in the vocabulary")
            heapq.heapify(heap)
            self.heaps[size] = heap
        avail = self.avail
        # Ranks only get busier between two placements, so each block's key is raised at most
        # once per call: more rounds than blocks means a time that compares false with itself
        # (NaN from a bad profile), which must be an error, not a loop that never ends.
        for _ in range(len(heap) + 1):
            key, start = heap[0]
            actual = max(avail[start:start + size]) if size > 1 else avail[start]
            if actual <= key:
                return start, actual
            heapq.heapreplace(heap, (actual, start))
        raise PlanError(f"the list scheduler made no progress placing a group of {size} ranks "
                        f"(rank free times {sorted(set(avail))[:4]}...): a task time is not a "
                        "finite number; check the hardware profile and the cost model inputs")

    def occupy(self, start: int, size: int, end: float) -> None:
        """Mark ranks ``[start, start + size)`` busy until ``end``."""
        avail = self.avail
        for r in range(start, start + size):
            avail[r] = end
        heap = self.heaps[size]
        if heap[0][1] == start:
            heapq.heapreplace(heap, (end, start))


def to_plan(pctx: PlanContext, drafts: Sequence[Draft], policy: str, skipped: Sequence[int],
            meta: Optional[dict] = None) -> Plan:
    """Turn timed drafts into a `Plan` (task ids in start order)."""
    order = sorted(range(len(drafts)), key=lambda k: (drafts[k].start, drafts[k].start_rank, k))
    tasks = []
    cm = pctx.cm
    for tid, k in enumerate(order):
        d = drafts[k]
        task = Task(id=tid, ranks=tuple(range(d.start_rank, d.start_rank + d.degree)),
                    seqs=tuple(d.seqs), ulysses=d.layout.ulysses, ring=d.layout.ring,
                    recompute_layers=d.recompute_layers, start=d.start, duration=d.duration,
                    slot=d.slot)
        # memory with the padding of the layout the task got (the runtime's own rule)
        tasks.append(replace(task, memory=cm.memory_model.task_memory(task, pctx.lengths)))
    frames = tuple(pctx.frame_tokens) if pctx.frame_tokens is not None else None
    return Plan(tasks=tuple(tasks), lengths=tuple(pctx.lengths), world_size=pctx.world,
                policy=policy, skipped=tuple(skipped), meta=dict(meta or {}), frame_tokens=frames)


def lighten(pctx: PlanContext, drafts: Sequence[Draft]) -> list[Draft]:
    """DCP-intra on a finished structure: every task gets the fewest recomputed layers that fit
    (same ranks, sequences and order)."""
    result = []
    for d in drafts:
        tokens = pctx.padded_tokens(d.seqs, d.degree)
        recompute_layers = pctx.recompute_for(tokens, d.degree, pctx.recompute_mode)
        if recompute_layers is None or recompute_layers >= d.recompute_layers:
            result.append(replace(d))
        else:
            result.append(pctx.draft(d.start_rank, d.degree, d.seqs, recompute_layers, d.release))
    return result
