"""Lockstep schedules: every rank runs the same micro-step slots, each slot one number of
recomputed layers.

ZeRO-3 all-gathers every module's parameters over the DCP world in forward, backward and
recompute, ZeRO-2 reduce-scatters gradients in every backward: both need every rank to run the
same number of micro-steps, and ZeRO-3 the same modules in each (the same recomputed layers). In
a lockstep plan a slot lasts as long as its longest task (`retime_slots`); a rank without a task
in a slot runs an empty micro-step with the slot's recomputed layers. So DCP keeps its freedom
inside a slot: groups of any size side by side, short sequences packed to the slot's length.

`lockstep_pass` builds slots in three steps, longest work first:

1. *Wide or deep items* (a sequence whose degree is above 1 or that needs more recompute than
   the short ones; in a floor pass, the short ones of a degree packed into groups, `_packed`,
   which join as one): each slot is opened by the longest one left (its length and recomputed
   layers are the slot's); later ones join the first slot where a free group of their degree
   (or a wider one, while work grows less than `MAX_WORK_GROWTH`) finishes within the slot at
   its recomputed layers, or pack into a group of their degree already there (with ``extend``:
   else lengthen the slot where that costs least, if less than a slot of their own).
2. *Short items* (one rank, the base recomputed layers) fill the ranks those slots leave free,
   worst-fit decreasing (each to the rank of a slot with the most time left, packed into one
   task).
3. The short items left over get slots of their own: as few as memory (and ``pack_tokens``)
   allow, every rank's task balanced to the same length.

`lockstep_candidates` runs the passes of `LOCKSTEP_PASSES`; `to_slots` turns any free schedule
(the baselines') into a lockstep one in its own order.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Callable, Optional, Sequence

from megatron_dcp.plan.choices import (MAX_WORK_GROWTH, OVERHEAD_TASKS, SeqChoice, fill_options,
                                       floor_of, full_choices, passes_for, raised)
from megatron_dcp.plan.cost import Layout
from megatron_dcp.plan.drafts import Draft, PlanContext, retime_slots

MEMORY_SLACK = 0.9
"""Step 3 plans the short items' slots to fill at most this share of a rank's token capacity:
packing is not perfect, and a slot that overflows would need another."""
GRAIN, GRAIN_TOKENS, TAIL = 0.02, 0.02, 2.0
"""`_packed` (the floor passes) groups short items up to ``GRAIN`` x the target slot length and
``GRAIN_TOKENS`` x the tokens a task of their degree holds at their recomputed layers (memory
binds where short sequences fill a slot: coarser groups leave it unused), and each group within
1 / (``TAIL`` x the groups of its degree side by side in a slot) of the time and tokens of the
items after it (the last ones stay fine enough to fill what the groups leave)."""
PACK_FROM = 2000
"""`_packed` runs where a pass has more wide items than this (where joining them one by one sets
the planning time; below it, packing saves little time and can cost a little balance)."""
LOCKSTEP_PASSES = (("node", 1.0, "auto", False, GRAIN), ("node", 1.0, "auto", True, GRAIN),
                   ("node", 1.0, "full", True, GRAIN), (1, 0.25, "auto", False, 0.0),
                   ("node", 1.0, "full", False, GRAIN), ("node", 0.5, "auto", True, GRAIN),
                   (1, 0.5, "auto", False, 0.0), (1, 0.25, "full", False, 0.0))
"""(degree floor, target factor, recompute, extend, packing grain) of the lockstep passes, most
useful first:
the target is the slot length a wide sequence should stay within (a multiple of the lower
bound); recompute ``full`` (every layer, where the recompute mode is ``auto``) fits several
times the tokens into a slot: fewer slots, where each costs ZeRO-3's parameter all-gathers;
``extend`` lets a sequence lengthen a slot rather than open one (better where few sequences are
left over, worse where later ones would fill a new slot); a grain above 0 packs short items of
a floor pass into groups before step 1 (`_packed`: a floor raises thousands of them to one
node's ranks; each joins slots as one item)."""


class _Item:
    """Sequences that join a slot together (one, or short ones packed by `_packed`) with the
    degree and recomputed layers they run at, and their time there."""

    __slots__ = ("seqs", "raw", "pairs", "degree", "recompute_layers", "time", "_options",
                 "_untried", "_padded")

    def __init__(self, ctx: PlanContext, seqs: list[int], raw: int, pairs: float, degree: int,
                 recompute_layers: int, time: float,
                 options: Optional[Sequence[tuple[int, int]]] = (),
                 padded: Optional[int] = None) -> None:
        self.seqs, self.raw, self.pairs = seqs, raw, pairs
        """``raw`` and ``pairs``: the sums over ``seqs`` in their order (as a draft sums them)."""
        self.degree, self.recompute_layers, self.time = degree, recompute_layers, time
        self._options: Sequence[tuple[int, int]] = options if options is not None else []
        self._untried = None if options is not None else bisect_left(ctx.vocab.sizes, degree)
        """Index in the vocabulary's sizes of the next size to test for `options` (``None``:
        ``_options`` is complete)."""
        self._padded: dict[int, int] = {} if padded is None else {degree: padded}

    def padded(self, ctx: PlanContext, degree: int) -> int:
        """Tokens after padding on ``degree`` ranks (cached: a pass asks for them many times)."""
        found = self._padded.get(degree)
        if found is None:
            found = self._padded[degree] = ctx.padded(self.raw, degree) if len(self.seqs) == 1 \
                else ctx.padded_tokens(self.seqs, degree)
        return found

    def option(self, ctx: PlanContext, mode: str, k: int) -> Optional[tuple[int, int]]:
        """The ``k``-th (degree, fewest recomputed layers) of the vocabulary sizes from
        ``degree`` on where the item fits (``None`` past the last): shared by the items of one
        length where `_choose` found them (read only), else (a packed group, a sequence that
        took its first option) found one by one as they are asked for (most take the first)."""
        found = self._options
        if k < len(found):
            return found[k]
        if self._untried is not None:
            sizes = ctx.vocab.sizes
            while k >= len(found) and self._untried < len(sizes):
                d = sizes[self._untried]
                self._untried += 1
                c = ctx.recompute_for(self.padded(ctx, d), d, mode)
                if c is not None:
                    found.append((d, c))
            if k < len(found):
                return found[k]
        return None


class _Task:
    """A task of a slot being filled: a group of ranks and the sequences packed on it."""

    __slots__ = ("slot", "start", "degree", "index", "seqs", "padded", "raw", "pairs", "time",
                 "layout", "summed")

    def __init__(self, slot: "_Slot", start: int, size: int, index: int) -> None:
        self.slot, self.start, self.degree = slot, start, size
        self.index = index
        """Position among the slot's tasks of this size (``_Slot.by_size``)."""
        self.seqs: list[int] = []
        self.padded = 0
        """Tokens after padding at ``degree``: what the task's memory counts."""
        self.raw = 0
        self.pairs = 0.0
        self.time = 0.0
        self.layout: Optional[Layout] = None
        """The layout of ``time`` (`TimeModel.best_time` at the slot's recomputed layers)."""
        self.summed = True
        """Whether ``pairs`` was summed in the order of ``seqs``, one sequence at a time (as a
        draft sums them: its time and layout are the draft's), not a packed group added to
        others."""

    def add(self, item: _Item, padded: int, best: tuple[float, Layout]) -> None:
        """Add ``item``, with the task's padded tokens and `best_time` after it."""
        if self.seqs and len(item.seqs) > 1:
            self.summed = False
        self.seqs += item.seqs
        self.padded, self.raw = padded, self.raw + item.raw
        self.pairs += item.pairs
        self.time, self.layout = best

    def with_item(self, ctx: PlanContext, item: _Item, tokens: int, mode: str
                  ) -> Optional[tuple[int, tuple[float, Layout]]]:
        """(padded tokens, `best_time`) of the task with ``item`` (``tokens`` after padding at
        the task's degree) added; ``None`` if that does not fit the slot's recomputed layers,
        the pack budget (an item alone may exceed it) or its length."""
        padded = self.padded + tokens
        if self.seqs and ctx.pack_tokens and padded > ctx.pack_tokens:
            return None
        if not self.slot.fits(ctx, padded, self.degree, mode):
            return None
        best = ctx.cm.time_model.best_time(self.raw + item.raw, self.pairs + item.pairs,
                                           self.degree, self.slot.recompute_layers)
        return (padded, best) if best[0] <= self.slot.length else None


@dataclass
class _Slot:
    """A slot being filled: its recomputed layers, its length (its first task's time) and its
    tasks."""

    recompute_layers: int
    length: float
    busy: bytearray
    tasks: list[_Task] = field(default_factory=list)
    by_size: dict[int, list[_Task]] = field(default_factory=dict)
    emptiest: dict[int, _Task] = field(default_factory=dict)
    """The task of each group size with the most time left (the first such in ``by_size``)."""
    heaps: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    """(time, index in ``by_size``) of every task of a size: entries whose time is no longer the
    task's are dropped when they come on top (a lazy heap: `added` in O(log n))."""
    no_block: set[int] = field(default_factory=set)
    """Sizes of which no free group is left."""
    next_block: dict[int, int] = field(default_factory=dict)
    """Per size, the index into the vocabulary's starts before which every group is busy."""
    free: int = -1
    """Ranks without a task (-1: all of ``busy``; kept by `_occupy`)."""
    widest: int = -1
    """Index in the vocabulary's sizes above which no size has a free group (-1: not known
    yet; ranks only get busier: `_Board._widest_free` resumes from it)."""
    local_fits: list[int] = field(default_factory=lambda: [0, 1 << 62])
    """Most tokens per rank known to fit at the slot's recomputed layers, fewest known not to
    (memory grows with them: tokens in between are asked of the cost model, once)."""

    def fits(self, ctx: PlanContext, padded: int, degree: int, mode: str) -> bool:
        """Whether a task of ``padded`` tokens on ``degree`` ranks fits within the slot's
        recomputed layers under the recompute ``mode`` (memory is per rank: only the tokens per
        rank matter)."""
        local, known = -(-padded // degree), self.local_fits
        if local <= known[0]:
            return True
        if local >= known[1]:
            return False
        c = ctx.recompute_for(padded, degree, mode)
        ok = c is not None and c <= self.recompute_layers
        known[0 if ok else 1] = local
        return ok

    def added(self, task: _Task) -> None:
        """Keep `emptiest` right after ``task`` got a sequence."""
        same = self.by_size[task.degree]
        heap = self.heaps.setdefault(task.degree, [])
        heapq.heappush(heap, (task.time, task.index))
        while heap[0][0] != same[heap[0][1]].time:
            heapq.heappop(heap)
        self.emptiest[task.degree] = same[heap[0][1]]


def _choose(ctx: PlanContext, info: SeqChoice, mode: str, target: float, base: int,
            lift: Callable[[SeqChoice], SeqChoice]
            ) -> tuple[bool, int, int, float, Sequence[tuple[int, int]]]:
    """(whether the sequence is wide or deep, degree, recomputed layers, time, options) of a
    sequence at its pass's choice (``lift``: raised to the pass's floor, or under recompute
    ``full``): a short one keeps that choice; a wide or deep one takes the smallest degree at
    which it finishes within ``target`` without recompute beyond ``base`` (a deeper slot makes
    every task in it recompute), else the smallest at which it finishes within ``target``, else
    the fastest before work grows by `MAX_WORK_GROWTH`."""
    up = lift(info)
    if up.degree <= 1 and up.recompute_layers <= base:
        return False, 1, up.recompute_layers, up.time, ()
    if not up.fits:
        if up.recompute_layers <= base and up.time <= target:
            # its first option: most sequences of a floor pass (the options are found as an
            # item asks for them, `_Item.option`)
            return True, up.degree, up.recompute_layers, up.time, None
        fill_options(ctx, up, mode, up.degree)
    return (True, *_choose_new(ctx, up, target, base))


def _choose_new(ctx: PlanContext, info: SeqChoice, target: float, base: int
                ) -> tuple[int, int, float, list[tuple[int, int]]]:
    """`_choose` for a sequence whose choice is not in the pass's memo: (degree, recomputed
    layers, time, options)."""
    for d, c in info.fits:
        if c <= base:
            t = ctx.seq_time(info.length, info.pairs, d, c)
            if t <= target:
                return d, c, t, _from(info.fits, d)
            break
    best, work = None, None
    for d, c in info.fits:
        t = ctx.seq_time(info.length, info.pairs, d, c)
        if work is None:
            work = d * t
        elif d * t > MAX_WORK_GROWTH * work:
            break
        if t <= target:
            best = (d, c, t)
            break
        if best is None or t < best[2]:
            best = (d, c, t)
    d, c, t = best or (info.degree, info.recompute_layers, info.time)
    return d, c, t, _from(info.fits, d)


def _from(fits: Sequence[tuple[int, int]], degree: int) -> Sequence[tuple[int, int]]:
    """The options of ``fits`` (smallest degree first) from ``degree`` on."""
    for k, (d, _) in enumerate(fits):
        if d >= degree:
            return fits[k:]
    return ()


_Row = tuple  # (-time, sequence, length, pairs, `_choose`'s choice): a wide sequence, sortable


def _single(ctx: PlanContext, row: _Row) -> _Item:
    """The item of one wide sequence."""
    return _Item(ctx, [row[1]], row[2], row[3], *row[4][1:])


def _packed(ctx: PlanContext, rows: list[_Row], mode: str, limit: float) -> list[_Item]:
    """Wide sequences (``rows``, longest first) of one degree and recomputed layers that take at
    most ``limit`` seconds packed (next-fit, longest first) into groups of up to ``limit``
    seconds that fit memory at those layers (and ``pack_tokens``, and the bounds of
    `GRAIN_TOKENS` and `TAIL`), as the free passes pack: a group joins a slot in one step where
    its sequences would take one each (a floor pass raises thousands of short sequences to one
    node's ranks). Longer sequences, and groups of one, are items of their own."""
    out: list[_Item] = []
    kinds: dict[tuple[int, int], list[_Row]] = {}
    for row in rows:
        if row[4][3] > limit:
            out.append(_single(ctx, row))
        else:  # each kind's rows stay longest first
            kinds.setdefault(row[4][1:3], []).append(row)
    cap, best_time = ctx.pack_tokens or math.inf, ctx.cm.time_model.best_time
    overhead = ctx.cm.time_model.task_overhead
    for (d, c), same in kinds.items():
        # a group is at most 1 / (TAIL x groups of d in a slot) of the work after it: the last
        # items stay fine enough to fill what the groups leave in every task
        # (time, tokens) the items from k on add to a task (time less its fixed cost): time or
        # memory may bind
        fine = TAIL * ctx.world / d
        tokens = GRAIN_TOKENS * d * ctx.cm.memory_model.max_local_tokens(c)
        pads = [ctx.padded(row[2], d) for row in same]
        after_time = list(accumulate((max(row[4][3] - overhead, 0.0) for row in reversed(same)),
                                     initial=0.0))[::-1]
        after_tokens = list(accumulate(reversed(pads), initial=0))[::-1]
        group, timed = [same[0]], None
        raw, pairs, padded = same[0][2], same[0][3], pads[0]
        for k in range(1, len(same) + 1):
            row = same[k] if k < len(same) else None
            if row is not None:
                more = padded + pads[k]
                fine_tokens = more <= cap and more <= min(tokens, after_tokens[k + 1] / fine)
                layers = ctx.recompute_for(more, d, mode) if fine_tokens else None
                if layers is not None and layers <= c:  # timed only where the tokens pass
                    t = best_time(raw + row[2], pairs + row[3], d, c)
                    if t[0] <= min(limit, after_time[k + 1] / fine):
                        group.append(row)
                        raw, pairs, padded, timed = raw + row[2], pairs + row[3], more, t
                        continue
            if len(group) == 1:
                out.append(_single(ctx, group[0]))
            else:  # `join_any` and the drafts ask for its time and layout again
                ctx.keep_best(raw, pairs, d, c, timed)
                out.append(_Item(ctx, [g[1] for g in group], raw, pairs, d, c, timed[0], None,
                                 padded))
            if row is not None:
                group, timed = [row], None
                raw, pairs, padded = row[2], row[3], pads[k]
    return out


def _free_block(ctx: PlanContext, slot: _Slot, size: int) -> Optional[int]:
    """First vocabulary group of ``size`` ranks that is free in a slot."""
    if size in slot.no_block:
        return None
    busy, starts = slot.busy, ctx.vocab.starts(size)
    for k in range(slot.next_block.get(size, 0), len(starts)):
        start = starts[k]
        if busy.find(1, start, start + size) < 0:  # no busy rank in the group
            slot.next_block[size] = k  # ranks only get busier: the groups before stay busy
            return start
    slot.no_block.add(size)
    return None


def _join(ctx: PlanContext, slot: _Slot, item: _Item, mode: str) -> bool:
    """Put a wide or deep item into ``slot`` if it finishes within the slot at its recomputed
    layers: packed into the task of its degree with the most time left, or on a free group of its
    degree (or a wider one, while its work grows less than `MAX_WORK_GROWTH`)."""
    size = item.degree
    # packing adds at least the item's time less the fixed per-task cost; a task whose tokens
    # per rank with the item's are known not to fit is passed over before any timing
    task, tokens = slot.emptiest.get(size), item.padded(ctx, size)
    if task is not None and -(-(task.padded + tokens) // size) < slot.local_fits[1] and \
            slot.length - task.time >= ctx.seq_time(item.raw, item.pairs, size,
                                                     slot.recompute_layers) - \
            ctx.cm.time_model.task_overhead:
        fit = task.with_item(ctx, item, tokens, mode)
        if fit is not None:
            task.add(item, *fit)
            slot.added(task)
            return True
    if not slot.free:  # no free group of any size
        return False
    work, k = None, 0
    while (found := item.option(ctx, mode, k)) is not None:
        d, c = found
        k += 1
        if c > slot.recompute_layers:
            continue
        best = ctx.seq_best(item.raw, item.pairs, d, slot.recompute_layers)
        t = best[0]
        if work is None:
            work = d * t
        elif d * t > MAX_WORK_GROWTH * work:
            return False
        if t > slot.length:
            continue
        start = _free_block(ctx, slot, d)
        if start is not None:
            task = _occupy(ctx, slot, start, d)
            task.add(item, item.padded(ctx, d), best)
            slot.added(task)
            return True
    return False


class _Board:
    """The slots of step 1 in order, with an index for `join_any`: per group size, the time left
    in every slot's emptiest task of that size (``inf`` while the slot has a free rank, ``-inf``
    without such a task) and its maximum per block of `BLOCK` slots, so that blocks where no
    slot can take an item are passed over whole; and the padded tokens that task can still take
    (`_room`: from what is known not to fit, so an entry may be too high, never too low)."""

    BLOCK = 16

    def __init__(self, ctx: PlanContext) -> None:
        self.ctx = ctx
        self.slots: list[_Slot] = []
        self.spare: dict[int, list[float]] = {}
        self.room: dict[int, list[float]] = {}
        self.block_max: dict[int, list[float]] = {}
        self.layers: set[int] = set()
        """Recomputed layers of the slots."""
        self._slot_times: dict[int, float] = {}

    def slot_time(self, layers: int) -> float:
        """`TimeModel.slot_time` (cached: `_extend` asks for it for every item)."""
        found = self._slot_times.get(layers)
        if found is None:
            found = self._slot_times[layers] = self.ctx.cm.time_model.slot_time(layers)
        return found

    @staticmethod
    def _spare(slot: _Slot, size: int) -> float:
        if slot.free:
            return math.inf
        task = slot.emptiest.get(size)
        return -math.inf if task is None else slot.length - task.time

    def _widest_free(self, slot: _Slot) -> int:
        """The widest size of which the slot has a free group (0: none)."""
        if not slot.free:
            return 0
        sizes = self.ctx.vocab.sizes
        k = slot.widest if slot.widest >= 0 else len(sizes) - 1
        while k >= 0 and _free_block(self.ctx, slot, sizes[k]) is None:
            k -= 1
        slot.widest = max(k, 0)
        return sizes[k] if k >= 0 else 0

    def _room(self, slot: _Slot, size: int, widest: int) -> float:
        """Padded tokens the emptiest task of ``size`` may still take: an item with more fits
        neither the slot's memory (the fewest tokens per rank known not to fit) nor the pack
        budget (``inf`` while the slot has a free group of that size or a wider one, ``widest``
        (`_widest_free`) at least ``size``: `_join` may open a task)."""
        task = slot.emptiest.get(size)
        if task is None or widest >= size:
            return math.inf
        room = (slot.local_fits[1] - 1) * size - task.padded
        pack = self.ctx.pack_tokens
        return min(room, pack - task.padded) if pack else room

    def add(self, slot: _Slot) -> None:
        """Append a new slot."""
        self.slots.append(slot)
        self.layers.add(slot.recompute_layers)
        widest = self._widest_free(slot)
        for size, spare in self.spare.items():
            spare.append(self._spare(slot, size))
            self.room[size].append(self._room(slot, size, widest))
            self._block(size, len(self.slots) - 1, -math.inf)

    def changed(self, k: int, size: Optional[int] = None) -> None:
        """Slot ``k`` got a task or a new length (every size's entries change), or a sequence
        packed into its emptiest task of ``size`` (only that size's entries change: the others'
        rooms may only have shrunk through what the slot learnt does not fit, and an entry may
        stay too high)."""
        slot = self.slots[k]
        widest = self._widest_free(slot)
        for s, spare in self.spare.items() if size is None else \
                ((size, self.spare[size]),) if size in self.spare else ():
            old, spare[k] = spare[k], self._spare(slot, s)
            self.room[s][k] = self._room(slot, s, widest)
            self._block(s, k, old)

    def _block(self, size: int, k: int, old: float) -> None:
        """Keep the maximum of ``k``'s block after its entry changed from ``old``."""
        b, spare, maxes = k // self.BLOCK, self.spare[size], self.block_max[size]
        new = spare[k]
        if b == len(maxes):
            maxes.append(max(spare[b * self.BLOCK:(b + 1) * self.BLOCK]))
        elif new >= maxes[b]:
            maxes[b] = new
        elif old >= maxes[b]:  # the maximum may have gone down
            maxes[b] = max(spare[b * self.BLOCK:(b + 1) * self.BLOCK])

    def _of(self, size: int) -> tuple[list[float], list[float], list[float]]:
        spare = self.spare.get(size)
        if spare is None:
            spare = self.spare[size] = [self._spare(slot, size) for slot in self.slots]
            self.room[size] = [self._room(slot, size, self._widest_free(slot))
                               for slot in self.slots]
            self.block_max[size] = [max(spare[i:i + self.BLOCK])
                                    for i in range(0, len(spare), self.BLOCK)]
        return spare, self.room[size], self.block_max[size]

    def join_any(self, ctx: PlanContext, item: _Item, mode: str) -> bool:
        """`_join` the item into the first slot that takes it. A slot without a free rank can
        only pack it into the task of its degree with the most time left: slots where that task
        has too little time left or too little memory are passed over without a call (the same
        tests `_join` starts with; blocks of slots where none can pass the first, in one step)."""
        size, layers, overhead = item.degree, item.recompute_layers, ctx.cm.time_model.task_overhead
        if len(self.layers) == 1:  # most boards: one least need (no table)
            need, (only,) = None, self.layers
            if only < layers:
                return False
            least = ctx.seq_time(item.raw, item.pairs, size, only) - overhead
        else:
            need = {c: ctx.seq_time(item.raw, item.pairs, size, c) - overhead
                    for c in self.layers if c >= layers}
            if not need:
                return False
            least = min(need.values())
        spare, rooms, maxes = self._of(size)
        slots, block, tokens = self.slots, self.BLOCK, item.padded(ctx, size)
        for b, top in enumerate(maxes):
            if top < least:
                continue
            for k in range(b * block, min((b + 1) * block, len(slots))):
                room = spare[k]
                if room < least or tokens > rooms[k]:
                    continue
                slot = slots[k]
                if slot.recompute_layers < layers or room != math.inf and \
                        room < (least if need is None else need[slot.recompute_layers]):
                    continue
                opened = len(slot.tasks)
                if _join(ctx, slot, item, mode):
                    self.changed(k, size if len(slot.tasks) == opened else None)
                    return True
                # it may have learnt what does not fit
                rooms[k] = self._room(slot, size, self._widest_free(slot))
        return False


def _extend(ctx: PlanContext, board: _Board, item: _Item, mode: str) -> bool:
    """Pack an item that fits no slot's length into the task of its degree where the slot grows
    least, if that growth costs less than a slot of its own (its time, at least the slot's ZeRO
    traffic)."""
    size, best, padded = item.degree, None, item.padded(ctx, item.degree)
    # a task past the pack budget with it, or known not to fit its slot's memory: `with_item`
    # would refuse it (with small budgets most tasks are full: tested here, not by a call)
    pack = ctx.pack_tokens - padded if ctx.pack_tokens else math.inf
    for k, slot in enumerate(board.slots):
        task = slot.emptiest.get(size)
        if slot.recompute_layers < item.recompute_layers or task is None or \
                task.padded > pack and task.seqs or \
                -(-(task.padded + padded) // size) >= slot.local_fits[1]:
            continue
        saved, slot.length = slot.length, math.inf
        fit = task.with_item(ctx, item, padded, mode)
        slot.length = saved
        if fit is not None and (best is None or fit[1][0] - saved < best[0]):
            best = (fit[1][0] - saved, k, task, fit)
    alone = max(item.time, board.slot_time(item.recompute_layers))
    if best is None or best[0] >= alone:
        return False
    _, k, task, fit = best
    slot = board.slots[k]
    task.add(item, *fit)
    slot.length = max(slot.length, task.time)
    slot.added(task)
    board.changed(k)
    return True


def _occupy(ctx: PlanContext, slot: _Slot, start: int, size: int) -> _Task:
    """A new, empty task on ranks ``[start, start + size)`` of ``slot``."""
    same = slot.by_size.setdefault(size, [])
    task = _Task(slot, start, size, len(same))
    slot.tasks.append(task)
    same.append(task)
    slot.busy[start:start + size] = b"\x01" * size
    slot.free = (len(slot.busy) if slot.free < 0 else slot.free) - size
    return task


def _fill(ctx: PlanContext, tasks: list[_Task], items: list[_Item], mode: str) -> list[_Item]:
    """Worst-fit decreasing of single-rank items (longest first) into ``tasks``: each to the one
    with the most time left of the few emptiest where it fits (an empty rank, or packed into a
    wider group's task: its ranks share it). Returns the items left over."""
    heap = [(t.time - t.slot.length, k) for k, t in enumerate(tasks)]
    heapq.heapify(heap)
    left = []
    for item in items:
        tried, placed = [], False  # entries are distinct: the heap's order is theirs alone
        while heap and len(tried) < 4:
            k = heap[0][1]
            task = tasks[k]
            size = task.degree
            padded = item.padded(ctx, size)
            # (known not to fit the slot's memory: `with_item` would refuse it)
            fit = None if -(-(task.padded + padded) // size) >= task.slot.local_fits[1] else \
                task.with_item(ctx, item, padded, mode)
            if fit is None:
                tried.append(heapq.heappop(heap))
                continue
            task.add(item, *fit)
            heapq.heapreplace(heap, (task.time - task.slot.length, k))
            placed = True
            break
        for entry in tried:
            heapq.heappush(heap, entry)
        if not placed:
            left.append(item)
    return left


def _least_loaded(ctx: PlanContext, tasks: list[_Task], items: list[_Item], mode: str
                  ) -> list[_Item]:
    """Each item into the least busy of ``tasks`` where memory allows, its slot growing past
    its planned length if need be (a few items left over from `_fill` do not justify a slot of
    their own). Returns the items that fit nowhere."""
    left = []
    for item in items:
        for task in sorted(tasks, key=lambda t: t.time)[:4]:
            saved, task.slot.length = task.slot.length, float("inf")
            fit = task.with_item(ctx, item, item.padded(ctx, task.degree), mode)
            task.slot.length = saved
            if fit is not None:
                task.add(item, *fit)
                task.slot.length = max(saved, task.time)
                break
        else:
            left.append(item)
    return left


def lockstep_items(ctx: PlanContext, same: Sequence[Sequence[SeqChoice]], mode: str,
                   target: float, grain: float, lift: Callable[[SeqChoice], SeqChoice]
                   ) -> tuple[list[_Item], list[_Item]]:
    """The wide or deep items (step 1; each sequence at its choice for the pass, ``lift`` of its
    `degree_choice`, and its degree chosen by `_choose` for slots of ``target`` seconds) and the
    short ones (steps 2-3) of a pass, longest first; ``grain`` > 0: wide items of at most
    ``grain x target`` seconds packed into groups of that length (`_packed`). ``same``: the
    sequences' `degree_choice` grouped by length and choice (one `_choose` per group: the same
    for each)."""
    base = ctx.cm.model.num_layers if mode == "full" else 0
    rows, short = [], []
    for group in same:
        found = _choose(ctx, group[0], mode, target, base, lift)
        if found[0]:
            rows += [(-found[3], info.i, info.length, info.pairs, found) for info in group]
        else:
            short += [_Item(ctx, [info.i], info.length, info.pairs, *found[1:4])
                      for info in group]
    rows.sort()  # longest first (then by sequence: the rows differ there)
    if grain > 0 and len(rows) > PACK_FROM:
        # groups of at least OVERHEAD_TASKS x the fixed per-task cost keep that cost small
        wide = _packed(ctx, rows, mode, max(grain * target, OVERHEAD_TASKS *
                                            ctx.cm.time_model.task_overhead))
        wide.sort(key=lambda x: (-x.time, x.seqs[0]))
    else:
        wide = [_single(ctx, row) for row in rows]
    short.sort(key=lambda x: (-x.time, x.seqs[0]))
    return wide, short


def lockstep_pass(ctx: PlanContext, items: tuple[list[_Item], list[_Item]], mode: str,
                  extend: bool = False) -> list[Draft]:
    """One lockstep schedule (see the module docstring) of the items of `lockstep_items` (read
    only: passes may share them); ``extend``: a wide item that fits no slot may lengthen one
    where that costs less than a slot of its own. Returns timed drafts."""
    world, cm = ctx.world, ctx.cm
    base = cm.model.num_layers if mode == "full" else 0
    wide, short = items
    board = _Board(ctx)
    slots = board.slots
    for item in wide:
        if not board.join_any(ctx, item, mode) and \
                not (extend and _extend(ctx, board, item, mode)):
            # a slot bound by ZeRO's traffic has room for more work at no cost
            layers = item.recompute_layers
            slot = _Slot(layers, max(item.time, board.slot_time(layers)), bytearray(world))
            task = _occupy(ctx, slot, _free_block(ctx, slot, item.degree), item.degree)
            task.add(item, item.padded(ctx, item.degree),
                     ctx.seq_best(item.raw, item.pairs, item.degree, layers))
            slot.added(task)
            board.add(slot)
    # step 2: short items on the ranks left free and in the wide tasks' spare time (none in
    # a floor pass that raised them all: no empty tasks to make)
    left = short
    if short:
        tasks = [t for slot in slots for t in slot.tasks]
        tasks += [_occupy(ctx, slot, r, 1) for slot in slots for r in range(world)
                  if not slot.busy[r]]
        left = _fill(ctx, tasks, short, mode)
    while left:  # step 3: slots of short sequences only, as few as memory allows
        cap = min(ctx.pack_tokens or math.inf, cm.memory_model.max_tokens(1, base)) * MEMORY_SLACK
        count = max(1, math.ceil(sum(x.raw for x in left) / (world * cap)))
        work = sum(x.time for x in left)
        length = max(left[0].time, work / (world * count), cm.time_model.slot_time(base))
        new = []
        for _ in range(count):
            slot = _Slot(base, length, bytearray(world))
            slots.append(slot)
            new += [_occupy(ctx, slot, r, 1) for r in range(world)]
        left = _least_loaded(ctx, new, _fill(ctx, new, left, mode), mode)
    drafts: list[Draft] = []
    for slot in slots:  # slots without a sequence are dropped (and not counted)
        k, layers = (drafts[-1].slot + 1 if drafts else 0), slot.recompute_layers
        for t in slot.tasks:
            if t.seqs:  # the task's own list: a draft may keep it
                draft = Draft(t.start, t.degree, t.seqs, layers, t.layout, t.time,
                              tokens=t.raw) if t.summed else \
                    ctx.draft(t.start, t.degree, t.seqs, layers)
                draft.slot = k
                drafts.append(draft)
    retime_slots(drafts, cm)
    return drafts


def to_slots(ctx: PlanContext, drafts: Sequence[Draft]) -> list[Draft]:
    """A free schedule in lockstep: each task in the first slot after its ranks' previous tasks
    (its own order kept), every task of a slot at the slot's deepest recompute. Timed."""
    order = sorted(drafts, key=lambda d: (d.start, d.start_rank))
    next_slot = [0] * ctx.world
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
        new = ctx.draft(d.start_rank, d.degree, d.seqs, recompute_layers[k], layout=d.layout) \
            if d.recompute_layers != recompute_layers[k] else replace(d)
        new.slot = k
        out.append(new)
    retime_slots(out, ctx.cm)
    return out


def lockstep_candidates(ctx: PlanContext, infos: list[SeqChoice], mode: str, bound: float,
                        longest: float) -> list[tuple[float, str, list[Draft]]]:
    """(makespan, name, timed drafts) of every lockstep pass this input gets (`LOCKSTEP_PASSES`;
    the ``full`` ones only where ``mode`` is ``auto``), from the sequences' degree choices
    ``infos`` under ``mode``; ``bound`` and ``longest`` as in `megatron_dcp.plan.dcp`."""
    passes = [(floor_of(ctx, floor), factor, mode if recompute == "auto" else recompute, extend,
               grain) for floor, factor, recompute, extend, grain in LOCKSTEP_PASSES
              if recompute == "auto" or mode == "auto"]
    # one choice per pass for the sequences of one length and `degree_choice` (an empty options
    # list is filled from the degree on by `_choose`: the same choice either way)
    groups: dict[tuple, list[SeqChoice]] = {}
    for info in infos:
        groups.setdefault((info.length, info.pairs, info.degree, info.recompute_layers,
                           info.time, len(info.fits)), []).append(info)
    same = list(groups.values())
    candidates = []
    lifts: dict[tuple[str, int], Callable] = {}  # passes of one floor share the choices
    made: dict[tuple, tuple[list[_Item], list[_Item]]] = {}  # and their items, of one target
    for floor, factor, recompute, extend, grain in passes_for(ctx, passes):
        target = max(bound * factor, longest)
        key = (recompute, floor, target, grain)
        if key not in made:
            if (recompute, floor) not in lifts:
                lifts[(recompute, floor)] = full_choices(ctx, floor) if recompute != mode else \
                    (lambda info, floor=floor: raised(ctx, info, mode, floor))
            made[key] = lockstep_items(ctx, same, recompute, target, grain,
                                       lifts[(recompute, floor)])
        drafts = lockstep_pass(ctx, made[key], recompute, extend)
        makespan = retime_slots(drafts, ctx.cm)
        name = (f"lockstep(floor={floor},M={factor},recompute={recompute}"
                f"{',extend' if extend else ''}{f',g={grain}' if grain else ''})")
        candidates.append((makespan, name, drafts))
    return candidates
