"""Lockstep slots while a pass fills them (`megatron_dcp.plan.lockstep`): a slot and its tasks
(`Slot`; a task being filled is a `Pack`, the ranks that have one its `Occupancy`) and the slots
in order with an index of the ones an item may join (`SlotIndex`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace
from typing import Iterator, NamedTuple, Optional

from megatron_dcp.plan.choices import Pack, WorkFloor, work_floor
from megatron_dcp.plan.cost import Layout
from megatron_dcp.plan.drafts import Occupancy, PlanContext, ceil_div
from megatron_dcp.plan.vocabulary import Vocabulary


class Slot:
    """A slot being filled: its recomputed layers, its ``duration`` (seconds: the longest task's,
    at least what it was opened for; it grows as its tasks do), its ranks and its tasks. A slot
    of a `SlotIndex` tells the index when it changes."""

    def __init__(self, vocab: Vocabulary, recompute_layers: int, duration: float) -> None:
        self.recompute_layers, self.duration = recompute_layers, duration
        self.occupancy = Occupancy(vocab)
        self.tasks: list[Pack] = []
        self.by_size: dict[int, list[Pack]] = {}
        self.sizes: list[int] = []
        """The keys of ``by_size``, ascending."""
        self.number = 0
        """The slot's place in its `SlotIndex`."""
        self.changed: Optional[set[int]] = None
        """Where the slot tells its index that it changed (the numbers of the slots changed
        since the index last looked), where it has one."""
        self._emptiest: dict[int, Pack] = {}
        self._memory = [0, 1 << 62]
        """Most tokens per rank known to fit at the slot's recomputed layers, fewest known not
        to (memory grows with them: only tokens in between are asked of the cost model)."""

    def open_task(self, start_rank: int, degree: int) -> Pack:
        """A new, empty task on ranks ``[start_rank, start_rank + degree)``."""
        task = Pack([], 0, 0.0, degree, self.recompute_layers, start_rank=start_rank)
        self.tasks.append(task)
        if degree not in self.by_size:
            self.by_size[degree] = []
            bisect.insort(self.sizes, degree)
        self.by_size[degree].append(task)
        self.occupancy.take(start_rank, degree)
        self._grew(task)
        return task

    def start(self, pctx: PlanContext, item: Pack, start_rank: int, degree: int) -> None:
        """A new task of ``item`` alone on ``[start_rank, start_rank + degree)``."""
        self.add(pctx, self.open_task(start_rank, degree), item,
                 pctx.seq_best(item.tokens, item.pairs, degree, self.recompute_layers))

    def pack(self, pctx: PlanContext, task: Pack, item: Pack, mode: str, limit: float) -> bool:
        """Pack ``item`` into ``task`` if that fits the slot's memory (`fits_memory`) and
        ``limit`` seconds (`Pack.timed_with`)."""
        timed = task.timed_with(pctx, item, mode, limit, fits=self.fits_memory)
        if timed is not None:
            self.add(pctx, task, item, timed)
        return timed is not None

    def add(self, pctx: PlanContext, task: Pack, item: Pack, timed: tuple[float, Layout]
            ) -> None:
        """Pack ``item`` into ``task`` (``timed``: the task's `Pack.timed_with` it); the slot
        lasts at least as long as the task."""
        task.add(pctx, item, timed)
        self._grew(task)
        self.duration = max(self.duration, task.duration)
        if self.changed is not None:
            self.changed.add(self.number)

    def emptiest(self, degree: int) -> Optional[Pack]:
        """The task of ``degree`` ranks with the most time left (the first such), if any."""
        found = self._emptiest.get(degree)
        if found is None and degree in self.by_size:
            found = self._emptiest[degree] = min(self.by_size[degree], key=_duration)
        return found

    def emptiest_wider(self, degree: int) -> Iterator[tuple[int, Pack]]:
        """(size, `emptiest` task) of every size of the slot's tasks above ``degree``, smallest
        first."""
        for size in self.sizes[bisect.bisect_right(self.sizes, degree):]:
            yield size, self.emptiest(size)

    def _grew(self, task: Pack) -> None:
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


def _duration(task: Pack) -> float:
    return task.duration


class Room(NamedTuple):
    """Upper bounds of what an item of one size can still get in a slot (all ``inf`` while the
    slot has a free group of that size or a wider one: a task may open there, `_ANY_ROOM`)."""

    seconds: float
    """Seconds the emptiest task of the size has left before the slot's duration (``-inf``:
    there is none)."""
    padded_tokens: float
    """Padded tokens that task can still take: memory at the slot's recomputed layers, as far
    as known, and the pack budget."""
    wider_work: float
    """Most work (ranks x seconds) the emptiest task of a wider size has left."""
    wider_tokens: float
    """Most tokens such a task can still take (an item may pack into a wider group's task)."""


_ANY_ROOM = Room(math.inf, math.inf, math.inf, math.inf)


class SlotIndex:
    """The slots of a pass in order, with each one's `Room` per item size: `candidates` names at
    least every slot that accepts an item (tests/test_lockstep.py checks it against the plain
    scan)."""

    def __init__(self, pctx: PlanContext) -> None:
        self.pctx = pctx
        self.slots: list[Slot] = []
        self._room: dict[int, list[Room]] = {}
        self.layers: set[int] = set()
        """Recomputed layers of the slots."""
        self._floors: dict[tuple[int, int, int], Optional[WorkFloor]] = {}
        self._changed: set[int] = set()
        """Slots that got a task, an item or a longer duration since the index last looked (it
        looks again when next asked)."""

    def add(self, slot: Slot) -> None:
        """Append a new slot."""
        slot.number, slot.changed = len(self.slots), self._changed
        self.slots.append(slot)
        self.layers.add(slot.recompute_layers)
        for size, room in self._room.items():
            room.append(self._room_of(slot, size))

    def candidates(self, size: int, least: float, padded_tokens: int, tokens: int,
                   pairs: float, layers: int) -> Iterator[int]:
        """Indices, in order, of the slots where an item of ``size`` ranks, ``tokens`` (before
        padding) and ``pairs`` may fit: one that adds at least ``least`` seconds and
        ``padded_tokens`` tokens to a task of its size, or its tokens and work (`least_work` at
        ``layers`` recomputed layers or more) to a wider one; at least every slot that accepts
        it."""
        for k in self._changed:
            for size_k, room_k in self._room.items():
                room_k[k] = self._room_of(self.slots[k], size_k)
        self._changed.clear()
        room = self._room.get(size)
        if room is None:
            room = self._room[size] = [self._room_of(slot, size) for slot in self.slots]
        work_needed = None
        for k, r in enumerate(room):
            if r.seconds >= least and r.padded_tokens >= padded_tokens:
                yield k
            elif r.wider_tokens >= tokens:
                if work_needed is None:
                    work_needed = self.least_work(tokens, pairs, size, layers)
                if r.wider_work >= work_needed:
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

    def _room_of(self, slot: Slot, size: int) -> Room:
        """The `Room` of ``slot`` for an item of ``size`` ranks."""
        if slot.occupancy.free and slot.occupancy.widest_free() >= size:
            return _ANY_ROOM
        work = tokens = -math.inf
        for d, task in slot.emptiest_wider(size):
            work = max(work, d * (slot.duration - task.duration))
            tokens = max(tokens, self._tokens_left(slot, task))
        task = slot.emptiest(size)
        if task is None:
            return Room(-math.inf, -math.inf, work, tokens)
        return Room(slot.duration - task.duration, self._tokens_left(slot, task), work, tokens)

    def _tokens_left(self, slot: Slot, task: Pack) -> float:
        """An upper bound of the padded tokens ``task`` can still take."""
        tokens = slot.most_local_tokens() * task.degree
        if task.seqs and self.pctx.pack_tokens:
            tokens = min(tokens, self.pctx.pack_tokens)
        return tokens - task.padded_tokens
