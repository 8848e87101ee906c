"""A finished lockstep slot's tasks on other groups (`megatron_dcp.plan.lockstep`): split over
narrower groups where that shortens a task (`narrowed`), merged into a wider group where that
shortens the slot (`merged`). Either way every rank keeps at most one task per slot, each task is
on a vocabulary group and fits memory at the slot's recomputed layers, and no slot gets longer.

*Narrowed*: a node-floor pass runs short sequences on one node's ranks so that they tile the
slots evenly; on fewer ranks the same sequences need less work (less all-to-all and ring traffic
per token). Each task of more than one sequence is split into two tasks on the halves of its
ranks (each half a vocabulary group), its sequences balanced over them (longest first, each to
the half with less time that fits its memory at the slot's recomputed layers), recursively,
while that shortens the task.

*Merged*: a slot lasts as long as its longest task, and where memory binds, the tasks beside a
long sequence are full of short ones and end early: their ranks idle. The slot's longest task
and the whole tasks (and free ranks) beside it become one task on the smallest vocabulary group
that holds them, where that task is shorter than the longest was: the long sequence's work
spreads over ranks that would idle. Repeated while the slot's longest task shortens.
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

from megatron_dcp.plan.drafts import Draft, PlanContext, retime_slots


def narrowed(pctx: PlanContext, drafts: Sequence[Draft], mode: str) -> list[Draft]:
    """``drafts`` (a timed lockstep schedule) with every task split where that shortens it
    (module doc), timed; ``mode``: the recompute mode the slots' recomputed layers follow."""
    out: list[Draft] = []
    for d in drafts:
        out += _split(pctx, d, mode) if len(d.seqs) > 1 else [d]
    retime_slots(out, pctx.cm)
    return out


def _split(pctx: PlanContext, task: Draft, mode: str) -> list[Draft]:
    """``task`` as is, or as the tasks of its halves (each split further) where the longest of
    those is shorter."""
    halves = _halves(pctx, task, mode)
    if halves is None:
        return [task]
    parts = [p for half in halves for p in (_split(pctx, half, mode) if len(half.seqs) > 1
                                             else [half])]
    return parts if max(p.duration for p in parts) < task.duration else [task]


def _halves(pctx: PlanContext, task: Draft, mode: str) -> Optional[list[Draft]]:
    """``task``'s sequences balanced over the two halves of its ranks by time, else (where
    that overflows a half's memory) by tokens (`None`: the halves are not vocabulary groups, or
    neither balance fits memory at the task's recomputed layers and the pack budget)."""
    half = task.degree // 2
    starts = (task.start_rank, task.start_rank + half)
    firsts = pctx.vocab.first_ranks(half)
    if task.degree % 2 or half not in pctx.vocab.sizes or any(s not in firsts for s in starts):
        return None
    lengths, pairs, layers = pctx.lengths, pctx.pairs, task.recompute_layers
    times = {s: pctx.seq_time(lengths[s], pairs[s], half, layers) for s in task.seqs}
    tokens = {s: pctx.padded(lengths[s], half) for s in task.seqs}
    for weight in (times, tokens):
        seqs: list[list[int]] = [[], []]
        load, padded = [0.0, 0.0], [0, 0]
        for s in sorted(task.seqs, key=lambda s: -weight[s]):
            fits = [k for k in (0, 1) if _fits(pctx, padded[k] + tokens[s], half, layers, mode,
                                               bool(seqs[k]))]
            if not fits:
                break
            k = min(fits, key=lambda k: load[k])
            seqs[k].append(s)
            load[k] += weight[s]
            padded[k] += tokens[s]
        else:
            out = [pctx.draft(start, half, part, layers) for start, part in zip(starts, seqs)
                   if part]
            for d in out:
                d.slot = task.slot
            return out
    return None


def _fits(pctx: PlanContext, padded_tokens: int, degree: int, layers: int, mode: str,
          packed: bool) -> bool:
    """Whether a task of ``padded_tokens`` on ``degree`` ranks fits memory within ``layers``
    recomputed layers and, ``packed`` (more than one sequence), the pack budget."""
    if packed and pctx.pack_tokens and padded_tokens > pctx.pack_tokens:
        return False
    c = pctx.recompute_for(padded_tokens, degree, mode)
    return c is not None and c <= layers


def merged(pctx: PlanContext, drafts: Sequence[Draft], mode: str) -> list[Draft]:
    """``drafts`` (a timed lockstep schedule) with each slot's longest task merged with the
    tasks beside it while that shortens the slot (module doc), timed; ``mode``: the recompute
    mode the slots' recomputed layers follow."""
    slots: dict[int, list[Draft]] = {}
    for d in drafts:
        slots.setdefault(d.slot, []).append(d)
    out: list[Draft] = []
    for k in sorted(slots):
        out += _flattened(pctx, slots[k], mode)
    retime_slots(out, pctx.cm)
    return out


def _flattened(pctx: PlanContext, tasks: list[Draft], mode: str) -> list[Draft]:
    """One slot's ``tasks`` with its longest task merged (`_merge`) until that no longer
    shortens it."""
    owner: list[Optional[Draft]] = [None] * pctx.world
    for t in tasks:
        owner[t.start_rank:t.start_rank + t.degree] = [t] * t.degree
    tasks = list(tasks)
    while True:
        longest = max(tasks, key=lambda t: t.duration)
        found = _merge(pctx, longest, owner, mode)
        if found is None:
            return tasks
        new, parts = found
        tasks = [t for t in tasks if all(t is not p for p in parts)] + [new]
        owner[new.start_rank:new.start_rank + new.degree] = [new] * new.degree


def _merge(pctx: PlanContext, longest: Draft, owner: list[Optional[Draft]], mode: str
           ) -> Optional[tuple[Draft, list[Draft]]]:
    """The task on the smallest vocabulary group around ``longest`` that holds whole tasks
    only (and free ranks), with all their sequences, where it fits memory at the slot's
    recomputed layers and is shorter than ``longest``; with the tasks it replaces. ``None``:
    no such group."""
    vocab, layers = pctx.vocab, longest.recompute_layers
    first, last = longest.start_rank, longest.start_rank + longest.degree
    for size in vocab.sizes:
        if size <= longest.degree:
            continue
        starts = vocab.first_ranks(size)
        k = bisect.bisect_right(starts, first) - 1
        if k < 0 or starts[k] + size < last:
            continue
        start = starts[k]
        parts: list[Draft] = []
        for r in range(start, start + size):
            t = owner[r]
            if t is not None and all(t is not p for p in parts):
                parts.append(t)
        if any(t.start_rank < start or t.start_rank + t.degree > start + size for t in parts):
            continue
        tokens, pairs = sum(t.tokens for t in parts), sum(t.pairs for t in parts)
        duration, layout = pctx.cm.time_model.best_time(tokens, pairs, size, layers)
        if duration >= longest.duration:
            continue
        seqs = [s for t in parts for s in t.seqs]
        if not _fits(pctx, pctx.padded_tokens(seqs, size), size, layers, mode, len(seqs) > 1):
            continue
        new = Draft(start, size, seqs, layers, layout, duration, tokens=tokens, pairs=pairs,
                    slot=longest.slot)
        return new, parts
    return None
