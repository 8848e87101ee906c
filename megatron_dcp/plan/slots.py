"""Lockstep slots while a pass fills them (`megatron_dcp.plan.lockstep`): which ranks of a slot
have a task (`Occupancy`), a task being filled (`SlotTask`), a slot (`Slot`) and the slots in
order with an index of the ones an item may join (`SlotIndex`).

Words: a slot's ``duration`` is seconds (its longest task's, or what it was opened for); a
task's ``padded_tokens`` are its tokens after padding at its degree (what memory counts);
``tokens`` are before padding.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from megatron_dcp.plan.choices import WorkFloor, work_floor
from megatron_dcp.plan.cost import Layout
from megatron_dcp.plan.drafts import PlanContext, ceil_div
from megatron_dcp.plan.lockstep_items import Item
from megatron_dcp.plan.vocabulary import Vocabulary


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


@dataclass(slots=True)
class Fit:
    """A task with one more item: its padded tokens, duration and best layout."""

    padded_tokens: int
    duration: float
    layout: Layout


@dataclass(eq=False, slots=True)
class SlotTask:
    """A task of a slot being filled: ranks ``[start_rank, start_rank + degree)`` and the
    sequences packed on them."""

    slot: "Slot"
    start_rank: int
    degree: int
    seqs: list[int] = field(default_factory=list)
    padded_tokens: int = 0
    tokens: int = 0
    pairs: float = 0.0
    duration: float = 0.0
    layout: Optional[Layout] = None
    """The layout of ``duration`` (`TimeModel.best_time` at the slot's recomputed layers)."""

    def with_item(self, pctx: PlanContext, item: Item, mode: str, limit: float) -> Optional[Fit]:
        """The task with ``item`` added, or ``None`` where that passes the pack budget (an item
        alone may exceed it), the slot's recomputed layers under the recompute ``mode``, or
        ``limit`` seconds."""
        padded = self.padded_tokens + item.padded(pctx, self.degree)
        if self.seqs and pctx.pack_tokens and padded > pctx.pack_tokens:
            return None
        if not self.slot.fits_memory(pctx, padded, self.degree, mode):
            return None
        duration, layout = pctx.cm.time_model.best_time(
            self.tokens + item.tokens, self.pairs + item.pairs, self.degree,
            self.slot.recompute_layers)
        return Fit(padded, duration, layout) if duration <= limit else None

    def add(self, item: Item, fit: Fit) -> None:
        """Add ``item``, with the task's `Fit` after it (`with_item`)."""
        self.seqs += item.seqs
        self.tokens += item.tokens
        self.pairs += item.pairs
        self.padded_tokens, self.duration, self.layout = fit.padded_tokens, fit.duration, \
            fit.layout
        self.slot.grew(self)


class Slot:
    """A slot being filled: its recomputed layers, its ``duration`` (seconds: the longest task's,
    at least what it was opened for), its ranks and its tasks."""

    def __init__(self, vocab: Vocabulary, recompute_layers: int, duration: float) -> None:
        self.recompute_layers, self.duration = recompute_layers, duration
        self.occupancy = Occupancy(vocab)
        self.tasks: list[SlotTask] = []
        self.by_size: dict[int, list[SlotTask]] = {}
        self.sizes: list[int] = []
        """The keys of ``by_size``, ascending."""
        self._emptiest: dict[int, SlotTask] = {}
        self._memory = [0, 1 << 62]
        """Most tokens per rank known to fit at the slot's recomputed layers, fewest known not
        to (memory grows with them: only tokens in between are asked of the cost model)."""

    def open_task(self, start_rank: int, degree: int) -> SlotTask:
        """A new, empty task on ranks ``[start_rank, start_rank + degree)``."""
        task = SlotTask(self, start_rank, degree)
        self.tasks.append(task)
        if degree not in self.by_size:
            self.by_size[degree] = []
            bisect.insort(self.sizes, degree)
        self.by_size[degree].append(task)
        self.occupancy.take(start_rank, degree)
        self.grew(task)
        return task

    def emptiest(self, degree: int) -> Optional[SlotTask]:
        """The task of ``degree`` ranks with the most time left (the first such), if any."""
        found = self._emptiest.get(degree)
        if found is None and degree in self.by_size:
            found = self._emptiest[degree] = min(self.by_size[degree], key=_duration)
        return found

    def emptiest_wider(self, degree: int) -> Iterator[tuple[int, SlotTask]]:
        """(size, `emptiest` task) of every size of the slot's tasks above ``degree``, smallest
        first."""
        for size in self.sizes[bisect.bisect_right(self.sizes, degree):]:
            yield size, self.emptiest(size)

    def grew(self, task: SlotTask) -> None:
        """Keep `emptiest` right after ``task`` opened or got an item (durations only grow: the
        emptiest task changes only where it was this one, found again when next asked for)."""
        now = self._emptiest.get(task.degree)
        if now is task:
            del self._emptiest[task.degree]
        elif now is not None and task.duration < now.duration:
            self._emptiest[task.degree] = task

    def fits_memory(self, pctx: PlanContext, padded_tokens: int, degree: int, mode: str) -> bool:
        """Whether a task of ``padded_tokens`` on ``degree`` ranks fits within the slot's
        recomputed layers under the recompute ``mode`` (only the tokens per rank matter)."""
        local, known = ceil_div(padded_tokens, degree), self._memory
        if local <= known[0]:
            return True
        if local >= known[1]:
            return False
        c = pctx.recompute_for(padded_tokens, degree, mode)
        ok = c is not None and c <= self.recompute_layers
        known[0 if ok else 1] = local
        return ok

    def most_local_tokens(self) -> float:
        """Tokens per rank below the fewest known not to fit (`fits_memory`)."""
        return self._memory[1] - 1

    def too_big(self, padded_tokens: int, degree: int) -> bool:
        """Whether ``padded_tokens`` on ``degree`` ranks are known not to fit (`fits_memory`
        would say no without asking the cost model)."""
        return ceil_div(padded_tokens, degree) >= self._memory[1]


def _duration(task: SlotTask) -> float:
    return task.duration


class SlotIndex:
    """The slots of a pass in order, with an index for joining: per group size and slot, an
    upper bound of the seconds and of the padded tokens an item of that size can still get
    there (both ``inf`` while the slot has a free group of that size or a wider one: a task may
    open there; else what its emptiest task of that size has left before the slot's duration,
    its memory at the slot's recomputed layers, as far as known, and the pack budget;
    ``-inf`` without such a task), and the most tokens the emptiest task of a wider size can
    still take (an item may pack into a wider group's task). `candidates` returns at least
    every slot that accepts the item (tests/test_lockstep.py checks it against the plain
    scan)."""

    def __init__(self, pctx: PlanContext) -> None:
        self.pctx = pctx
        self.slots: list[Slot] = []
        self._room: dict[int, list[tuple[float, float]]] = {}
        self.layers: set[int] = set()
        """Recomputed layers of the slots."""
        self._floors: dict[tuple[int, int, int], Optional[WorkFloor]] = {}

    def add(self, slot: Slot) -> None:
        """Append a new slot."""
        self.slots.append(slot)
        self.layers.add(slot.recompute_layers)
        for size, room in self._room.items():
            room.append(self._room_of(slot, size))

    def changed(self, k: int) -> None:
        """Slot ``k`` got a task, an item or a longer duration."""
        slot = self.slots[k]
        for size, room in self._room.items():
            room[k] = self._room_of(slot, size)

    def candidates(self, size: int, least: float, padded_tokens: int, tokens: int,
                   pairs: float, layers: int) -> Iterator[int]:
        """Indices, in order, of the slots where an item of ``size`` ranks, ``tokens`` (before
        padding) and ``pairs`` may fit: one that adds at least ``least`` seconds and
        ``padded_tokens`` tokens to a task of its size, or its tokens and work (`least_work` at
        ``layers`` recomputed layers or more) to a wider one; at least every slot that accepts
        it."""
        room = self._room.get(size)
        if room is None:
            room = self._room[size] = [self._room_of(slot, size) for slot in self.slots]
        work_needed = None
        for k, (spare, own, work, wider) in enumerate(room):
            if spare >= least and own >= padded_tokens:
                yield k
            elif wider >= tokens:
                if work_needed is None:
                    work_needed = self.least_work(tokens, pairs, size, layers)
                if work >= work_needed:
                    yield k

    def least_work(self, tokens: int, pairs: float, size: int, layers: int) -> float:
        """A lower bound of the work (ranks x seconds) an item of ``tokens`` and ``pairs`` adds
        to a task of ``size`` ranks or more at ``layers`` recomputed layers or more (of the
        slots'): the `WorkFloor` of every such option, less each rank's fixed per-task cost,
        each part the least."""
        key = (size, layers, len(self.layers))  # slots only add recomputed-layer counts
        floor = self._floors.get(key)
        if floor is None:
            overhead, floor = self.pctx.cm.time_model.task_overhead, None
            for d in self.pctx.vocab.sizes:
                for c in self.layers:
                    if d >= size and c >= layers:
                        f = work_floor(self.pctx, d, c)
                        f = replace(f, fixed=f.fixed - d * overhead)
                        floor = f if floor is None else floor.least(f)
            self._floors[key] = floor
        if floor is None:
            return math.inf
        # `of`'s rounding factor applies to the subtracted cost too: at most this much more
        return floor.of(tokens, pairs) - 1e-9 * self.pctx.world * \
            self.pctx.cm.time_model.task_overhead

    def _room_of(self, slot: Slot, size: int) -> tuple[float, float, float, float]:
        """(seconds and padded tokens the emptiest task of ``size`` ranks has left, most work
        and tokens that of a wider size has left) in ``slot``."""
        if slot.occupancy.free and slot.occupancy.widest_free() >= size:
            return math.inf, math.inf, math.inf, math.inf
        work = tokens = -math.inf
        for d, task in slot.emptiest_wider(size):
            work = max(work, d * (slot.duration - task.duration))
            tokens = max(tokens, self._tokens_left(slot, task))
        task = slot.emptiest(size)
        if task is None:
            return -math.inf, -math.inf, work, tokens
        return slot.duration - task.duration, self._tokens_left(slot, task), work, tokens

    def _tokens_left(self, slot: Slot, task: SlotTask) -> float:
        """An upper bound of the padded tokens ``task`` can still take."""
        tokens = slot.most_local_tokens() * task.degree
        if task.seqs and self.pctx.pack_tokens:
            tokens = min(tokens, self.pctx.pack_tokens)
        return tokens - task.padded_tokens
