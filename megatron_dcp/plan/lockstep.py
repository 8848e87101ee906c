"""Lockstep schedules: every rank runs the same micro-step slots, each slot one number of
recomputed layers (ZeRO-2 reduce-scatters gradients in every backward, ZeRO-3 all-gathers every
module's parameters: every rank must run as many micro-steps, and under ZeRO-3 the same modules).
A slot lasts as long as its longest task (`retime_slots`); a rank without a task in a slot runs
an empty micro-step. Inside a slot DCP keeps its freedom: groups of any size side by side, short
sequences packed to the slot's length.

`lockstep_pass` builds slots in three steps, longest work first:

1. *Wide or deep items* (`lockstep_items`: a sequence of a degree above 1 or more recompute than
   the short ones; in a floor pass, short ones of a degree packed into groups) each open a slot
   (its duration and recomputed layers) or join the first slot where they finish within it at
   its recomputed layers (`join`; with ``extend``, else lengthen the slot where that costs least,
   if less than a slot of their own).
2. *Short items* (one rank, the base recomputed layers) fill the ranks those slots leave free,
   worst-fit decreasing (`fill`).
3. The short items left over get slots of their own: as few as memory (and ``pack_tokens``)
   allow, every rank's task balanced to the same duration (`short_slots`).

`lockstep_candidates` runs the passes of `LOCKSTEP_PASSES` and regroups the shortest one's slots
(`megatron_dcp.plan.lockstep_regroup`).
"""
from __future__ import annotations

import heapq
import math
from functools import partial
from typing import Callable, NamedTuple, Optional, Sequence, Union

from megatron_dcp.plan.choices import (MAX_WORK_GROWTH, OVERHEAD_TASKS, Pack, SeqChoice,
                                       floor_of, full_lift, next_fit, passes_for, raised,
                                       least_makespan, slot_choice)
from megatron_dcp.plan.drafts import Candidate, Draft, PlanContext, retime_slots
from megatron_dcp.plan.lockstep_regroup import merged, narrowed
from megatron_dcp.plan.slots import Slot, SlotIndex

MEMORY_SLACK = 0.9
"""Step 3 plans the short items' slots to fill at most this share of a rank's token capacity:
packing is not perfect, and a slot that overflows would need another."""
GRAIN = 0.02
"""Packing grain of the node-floor passes (`LockstepPass.grain`)."""


class LockstepPass(NamedTuple):
    """One lockstep pass."""

    floor: Union[int, str]
    """Smallest degree of every sequence (``"node"``: one node's ranks)."""
    target: float
    """The slot duration a wide sequence should stay within, a multiple of the lower bound."""
    recompute: str
    """``auto``: the recompute mode; ``full``: every layer, where the mode is ``auto`` (fewer
    slots, where each costs ZeRO-3's all-gathers)."""
    extend: bool
    """A sequence may lengthen a slot rather than open one (better where few are left over,
    worse where later ones would fill a new slot)."""
    grain: float
    """Above 0, wide items of a floor pass are packed into groups (`lockstep_items`)."""

    def name(self) -> str:
        """The candidate's name."""
        return (f"lockstep(floor={self.floor},M={self.target},recompute={self.recompute}"
                f"{',extend' if self.extend else ''}{f',g={self.grain}' if self.grain else ''})")


LOCKSTEP_PASSES = (
    LockstepPass("node", 1.0, "auto", False, GRAIN), LockstepPass("node", 1.0, "auto", True, GRAIN),
    LockstepPass("node", 1.0, "full", True, GRAIN), LockstepPass(1, 0.25, "auto", False, 0.0),
    LockstepPass("node", 1.0, "full", False, GRAIN), LockstepPass("node", 0.5, "auto", True, GRAIN),
    LockstepPass(1, 0.5, "auto", False, 0.0), LockstepPass(1, 0.25, "full", False, 0.0))
"""The lockstep passes, most useful first."""
FILL_TRIES = 4
"""Step 2 and 3 try an item on this many of the emptiest tasks before giving up on it."""
GRAIN_TOKENS, TAIL = 0.02, 2.0
"""`next_fit`'s bounds of the wide items' groups: memory binds where short sequences fill a slot
(coarser groups leave it unused); the last groups stay fine enough to fill what others leave."""
PACK_FROM = 2000
"""Wide items are packed where a pass has more of them than this (where joining them one by one
sets the planning time; below it, packing saves little time and can cost a little balance)."""


def join(pctx: PlanContext, slot: Slot, item: Pack, mode: str) -> bool:
    """Put a wide or deep item into ``slot`` if it finishes within the slot's duration at the
    slot's recomputed layers: packed into the task of its degree with the most time left, on
    the first free group of its degree (or a wider one, while its work grows less than
    `MAX_WORK_GROWTH`), or packed into the emptiest task of a wider size (smallest first: time
    its ranks would idle)."""
    own = slot.emptiest(item.degree)
    if own is not None and _pack(pctx, slot, own, item, mode):
        return True
    if slot.occupancy.free and _open(pctx, slot, item, mode):
        return True
    return any(_pack(pctx, slot, task, item, mode) for _, task in
               slot.emptiest_wider(item.degree))


def _pack(pctx: PlanContext, slot: Slot, task: Pack, item: Pack, mode: str) -> bool:
    """Pack ``item`` into ``task`` if it finishes within the slot's duration."""
    d, spare, overhead = task.degree, slot.duration - task.duration, \
        pctx.cm.time_model.task_overhead
    # packing adds at least the item's time less the fixed per-task cost (checked before the
    # task with the item is timed), on a wider task its work spread over the task's ranks
    if slot.too_big(task.padded_tokens + item.padded(pctx, d), d) or \
            spare < item.duration * item.degree / d - overhead or \
            spare < pctx.seq_time(item.tokens, item.pairs, d, slot.recompute_layers) - overhead:
        return False
    return slot.pack(pctx, task, item, mode, slot.duration)


def _open(pctx: PlanContext, slot: Slot, item: Pack, mode: str) -> bool:
    """Start a task of ``item`` on the first free group of its degree (or a wider one, while
    its work grows less than `MAX_WORK_GROWTH`) where it finishes within the slot's duration."""
    layers, work = slot.recompute_layers, None
    for d, c in item.options(pctx, mode):
        if c > layers:
            continue
        duration = pctx.seq_time(item.tokens, item.pairs, d, layers)
        if work is None:
            work = d * duration
        elif d * duration > MAX_WORK_GROWTH * work:
            return False
        if duration > slot.duration:
            continue
        start = slot.occupancy.first_free(d)
        if start is not None:
            slot.start(pctx, item, start, d)
            return True
    return False


def join_first(pctx: PlanContext, index: SlotIndex, item: Pack, mode: str) -> bool:
    """`join` the item into the first slot that takes it (of those `SlotIndex.candidates`
    names: at least every slot that does)."""
    size, overhead = item.degree, pctx.cm.time_model.task_overhead
    deep = [c for c in index.layers if c >= item.recompute_layers]
    if not deep:
        return False
    least = min(pctx.seq_time(item.tokens, item.pairs, size, c) for c in deep) - overhead
    for k in index.candidates(size, least, item.padded(pctx, size), item.tokens, item.pairs,
                              item.recompute_layers):
        slot = index.slots[k]
        if slot.recompute_layers >= item.recompute_layers and join(pctx, slot, item, mode):
            return True
    return False


def extend(pctx: PlanContext, index: SlotIndex, item: Pack, mode: str) -> bool:
    """Pack an item that fits no slot's duration into the task of its degree where the slot
    grows least, if that growth costs less than a slot of its own (`TimeModel.slot_duration`:
    its duration, at least the slot's ZeRO traffic)."""
    best, growth = None, pctx.cm.time_model.slot_duration(item.recompute_layers, item.duration)
    for slot in index.slots:
        task = slot.emptiest(item.degree)
        if slot.recompute_layers < item.recompute_layers or task is None:
            continue
        # only a growth below the least so far counts (the limit a hair above it: rounding)
        timed = task.timed_with(pctx, item, mode, (slot.duration + growth) * (1.0 + 1e-12),
                                fits=slot.fits_memory)
        if timed is not None and timed[0] - slot.duration < growth:
            best, growth = slot, timed[0] - slot.duration
    return best is not None and best.pack(pctx, best.emptiest(item.degree), item, mode, math.inf)


def slot_tasks(slots: list[Slot]) -> tuple[list[Slot], list[Pack]]:
    """The tasks of ``slots``, then a new task on each of their free ranks, and by the same index
    each one's slot (what `fill` fills)."""
    owner = [slot for slot in slots for _ in slot.tasks]
    owner += [slot for slot in slots for _ in range(slot.occupancy.free)]
    tasks = [t for slot in slots for t in slot.tasks]
    tasks += [slot.open_task(r, 1) for slot in slots for r in slot.occupancy.free_ranks()]
    return owner, tasks


def fill(pctx: PlanContext, owner: list[Slot], tasks: list[Pack], items: list[Pack], mode: str,
         limit: bool) -> list[Pack]:
    """Worst-fit decreasing of single-rank items (longest first) into ``tasks`` (of the slots
    ``owner``, by index: `slot_tasks`): each to the task with the most time left in its slot of
    the `FILL_TRIES` emptiest where it fits (an empty rank, or packed into a wider group's task:
    its ranks share it). ``limit``: within the slot's duration; else the least busy task (by
    duration), the slot growing past its duration (a few items left over do not justify a slot
    of their own). Returns the items left over."""
    def key(k: int) -> float:
        return tasks[k].duration - owner[k].duration if limit else tasks[k].duration

    heap = [(key(k), k) for k in range(len(tasks))]
    heapq.heapify(heap)
    left = []
    for item in items:
        tried, placed = [], False
        while heap and len(tried) < FILL_TRIES:
            k = heap[0][1]
            slot = owner[k]
            if not slot.pack(pctx, tasks[k], item, mode, slot.duration if limit else math.inf):
                tried.append(heapq.heappop(heap))
                continue
            heapq.heapreplace(heap, (key(k), k))
            placed = True
            break
        for entry in tried:
            heapq.heappush(heap, entry)
        if not placed:
            left.append(item)
    return left


def lockstep_pass(pctx: PlanContext, items: tuple[list[Pack], list[Pack]], mode: str,
                  extend_slots: bool = False) -> list[Draft]:
    """One lockstep schedule (see the module docstring) of the items of `lockstep_items` (read
    only: passes may share them); ``extend_slots``: a wide item that fits no slot may lengthen
    one where that costs less than a slot of its own. Returns timed drafts."""
    world, cm, vocab = pctx.world, pctx.cm, pctx.vocab
    base = cm.model.num_layers if mode == "full" else 0
    wide, short = items
    index = SlotIndex(pctx)
    for item in wide:  # step 1
        if join_first(pctx, index, item, mode) or \
                extend_slots and extend(pctx, index, item, mode):
            continue
        # a slot bound by ZeRO's traffic has room for more work at no cost
        layers = item.recompute_layers
        slot = Slot(vocab, layers, cm.time_model.slot_duration(layers, item.duration))
        slot.start(pctx, item, slot.occupancy.first_free(item.degree), item.degree)
        index.add(slot)
    slots = index.slots
    left = short
    if short:  # step 2: the ranks left free and the wide tasks' spare time
        left = fill(pctx, *slot_tasks(slots), short, mode, limit=True)
    if left:  # step 3: slots of short sequences only, as few as memory allows
        # fewer items longer than the balanced duration than ranks: the others would idle
        duration = balanced_slots(pctx, left, base)[1]
        slots += short_slots(pctx, left, mode,
                             widen=sum(x.duration > duration for x in left) < world)
    drafts: list[Draft] = []
    for slot in (s for s in slots if any(t.seqs for t in s.tasks)):  # empty slots dropped
        k = drafts[-1].slot + 1 if drafts else 0
        for t in slot.tasks:
            if t.seqs:
                drafts.append(Draft(t.start_rank, t.degree, t.seqs, slot.recompute_layers,
                                    t.layout, t.duration, tokens=t.tokens, pairs=t.pairs,
                                    slot=k))
    retime_slots(drafts, cm)
    return drafts


def balanced_slots(pctx: PlanContext, items: list[Pack], base: int) -> tuple[int, float]:
    """How many slots the short ``items`` need (memory, `MEMORY_SLACK` and ``pack_tokens``) and
    the duration at which each rank of them has the same work."""
    cm, world = pctx.cm, pctx.world
    cap = min(pctx.pack_tokens or math.inf, cm.memory_model.max_tokens(1, base)) * MEMORY_SLACK
    count = max(1, math.ceil(sum(x.tokens for x in items) / (world * cap)))
    return count, cm.time_model.slot_duration(base, sum(x.duration for x in items) /
                                              (world * count))


def short_slots(pctx: PlanContext, items: list[Pack], mode: str, widen: bool) -> list[Slot]:
    """Step 3 of `lockstep_pass`: new slots for the short ``items`` (longest first), as few as
    memory (and ``pack_tokens``) allow, every rank's task balanced to the same duration.
    ``widen``: an item longer than that duration, which would set its slot's, runs on more
    ranks where that saves time (`widened`); without any, the same as without ``widen``."""
    cm, vocab = pctx.cm, pctx.vocab
    base = cm.model.num_layers if mode == "full" else 0
    slots: list[Slot] = []
    left = items
    while left:
        count, duration = balanced_slots(pctx, left, base)
        if not widen:
            duration = max(duration, cm.time_model.slot_duration(base, left[0].duration))
        new_slots = [Slot(vocab, base, duration) for _ in range(count)]
        for item in (widened(pctx, x, mode, duration, base) for x in left
                     if x.duration > duration):
            slot = next((s for s in new_slots if s.occupancy.first_free(item.degree) is not None),
                        None)
            if slot is None:
                slot = Slot(vocab, base, duration)
                new_slots.append(slot)
            slot.start(pctx, item, slot.occupancy.first_free(item.degree), item.degree)
        left = [x for x in left if x.duration <= duration]
        slots += new_slots
        owner, tasks = slot_tasks(new_slots)
        left = fill(pctx, owner, tasks, fill(pctx, owner, tasks, left, mode, limit=True), mode,
                    limit=False)
    return slots


def widened(pctx: PlanContext, item: Pack, mode: str, limit: float, base: int) -> Pack:
    """``item`` (one sequence, longer than ``limit``: a slot of ``limit`` seconds would last
    its duration) on more ranks at ``base`` recomputed layers where that saves the most
    rank-seconds: the other ranks' idle time past ``limit`` it cuts, less the work it adds (not
    past `MAX_WORK_GROWTH`); itself where no degree saves any."""
    best, gain, t0 = item, 0.0, item.duration
    for d, c in item.options(pctx, mode):
        if d <= item.degree or c > base:
            continue
        t = pctx.seq_time(item.tokens, item.pairs, d, base)
        if d * t > MAX_WORK_GROWTH * item.degree * t0:
            break
        saved = (t0 - max(t, limit)) * (pctx.world - d) - (d * t - item.degree * t0)
        if saved > gain:
            best, gain = Pack(item.seqs, item.tokens, item.pairs, d, c, t,
                                   padded_tokens=item.padded(pctx, d)), saved
    return best


def _longest_first(item: Pack) -> tuple[float, int]:
    return -item.duration, item.seqs[0]


def lockstep_items(pctx: PlanContext, same: Sequence[Sequence[SeqChoice]], mode: str,
                   target: float, grain: float, lift: Callable[[SeqChoice], SeqChoice]
                   ) -> tuple[list[Pack], list[Pack]]:
    """The wide or deep items and the short ones of a pass, longest first: each sequence at
    ``lift`` of its `degree_choice` (raised to the pass's floor, or its choice under recompute
    ``full`` from the floor on), its degree chosen by `slot_choice` for slots of ``target`` seconds
    where it is wide or deep; ``grain`` > 0: wide items of at most ``grain x target`` seconds
    packed (`next_fit`). ``same``: the sequences' choices grouped by length and choice (one
    `slot_choice` per group)."""
    base = pctx.cm.model.num_layers if mode == "full" else 0
    wide, short = [], []
    for group in same:
        info = lift(group[0])
        is_short = info.degree <= 1 and info.recompute_layers <= base
        chosen = info if is_short else slot_choice(pctx, info, mode, target, base)
        options = None if is_short else chosen.fitting_options or None
        d = 1 if is_short else chosen.degree
        padded = pctx.padded(info.length, d)  # one length per group
        for x in group:
            (short if is_short else wide).append(Pack(
                [x.i], x.length, x.pairs, d, chosen.recompute_layers, chosen.duration,
                padded_tokens=padded, fitting_options=options))
    wide.sort(key=_longest_first)
    if grain > 0 and len(wide) > PACK_FROM:
        # groups of at least OVERHEAD_TASKS x the fixed per-task cost keep that cost small
        limit = max(grain * target, OVERHEAD_TASKS * pctx.cm.time_model.task_overhead)
        wide = next_fit(pctx, wide, mode, limit, TAIL, GRAIN_TOKENS)
        wide.sort(key=_longest_first)
    short.sort(key=_longest_first)
    return wide, short


def lockstep_candidates(pctx: PlanContext, infos: list[SeqChoice], mode: str, bound: float,
                        longest: float, prune: bool = False) -> list[Candidate]:
    """The plan of every lockstep pass this input gets (`LOCKSTEP_PASSES`; the ``full`` ones
    only where ``mode`` is ``auto``), in the passes' order, from the sequences' degree choices
    ``infos`` under ``mode``; ``bound`` and ``longest`` as in `megatron_dcp.plan.dcp`.
    ``prune`` (where the shortest candidate wins): the ``full`` passes run after the others and
    are left out where `least_makespan` shows they cannot be shorter than the shortest so far.
    The shortest pass's slots are regrouped (`regrouped`)."""
    passes = passes_for(pctx, [p._replace(floor=floor_of(pctx, p.floor), recompute=mode
                                          if p.recompute == "auto" else p.recompute)
                               for p in LOCKSTEP_PASSES if p.recompute == "auto" or mode == "auto"])
    items = _pass_items(pctx, infos, mode)
    found: dict[int, Candidate] = {}
    full_floor: Optional[float] = None
    for k in sorted(range(len(passes)), key=lambda k: passes[k].recompute != mode):  # mode first
        p = passes[k]
        if prune and p.recompute != mode and found:
            if full_floor is None:
                full_floor = least_makespan(pctx, infos, pctx.cm.model.num_layers)
            if full_floor > min(c.makespan for c in found.values()):
                continue
        drafts = lockstep_pass(pctx, items(p, max(bound * p.target, longest)), p.recompute,
                               p.extend)
        found[k] = Candidate(retime_slots(drafts, pctx.cm), p.name(), drafts)
    if found:
        best = min(sorted(found), key=lambda k: found[k].makespan)
        found[best] = regrouped(pctx, found[best], passes[best].recompute)
    return [found[k] for k in sorted(found)]  # in the passes' order: ties keep it


def _pass_items(pctx: PlanContext, infos: list[SeqChoice], mode: str
                ) -> Callable[[LockstepPass, float], tuple[list[Pack], list[Pack]]]:
    """The items (`lockstep_items`) of a pass for its target, made once for the passes that
    share its recompute, floor, target and grain (their sequences lifted once for the passes of
    one recompute and floor); the sequences of one length and choice get one choice per pass."""
    groups: dict[tuple, list[SeqChoice]] = {}
    for info in infos:
        groups.setdefault((info.length, info.pairs, info.degree, info.recompute_layers,
                           info.duration, len(info.fitting_options)), []).append(info)
    same = list(groups.values())
    lifts: dict[tuple[str, int], Callable[[SeqChoice], SeqChoice]] = {}
    made: dict[tuple, tuple[list[Pack], list[Pack]]] = {}

    def items(p: LockstepPass, target: float) -> tuple[list[Pack], list[Pack]]:
        key = (p.recompute, p.floor, target, p.grain)
        if key not in made:
            if (p.recompute, p.floor) not in lifts:
                lifts[(p.recompute, p.floor)] = full_lift(pctx, infos, p.floor) \
                    if p.recompute != mode else partial(raised, pctx, mode=mode, floor=p.floor)
            made[key] = lockstep_items(pctx, same, p.recompute, target, p.grain,
                                       lifts[(p.recompute, p.floor)])
        return made[key]
    return items


def regrouped(pctx: PlanContext, candidate: Candidate, mode: str) -> Candidate:
    """``candidate``'s tasks on narrower groups where that shortens them, each slot's longest
    task on a wider group where that shortens the slot, and a merged task split again where its
    halves are shorter (never longer; `megatron_dcp.plan.lockstep_regroup`), timed."""
    drafts = narrowed(pctx, merged(pctx, narrowed(pctx, candidate.drafts, mode), mode), mode)
    return Candidate(retime_slots(drafts, pctx.cm), candidate.name, drafts)
