"""Narrower groups inside a finished lockstep slot (`narrowed`): a task of several sequences
split over halves of its ranks where that shortens it.

A node-floor pass runs short sequences on one node's ranks so that they tile the slots evenly
(`megatron_dcp.plan.lockstep`); on fewer ranks the same sequences need less work (less
all-to-all and ring traffic per token). Once a slot's tasks are known, each task of more than
one sequence is split into two tasks on the halves of its ranks (each half a vocabulary group),
its sequences balanced over them (longest first, each to the half with less time that fits its
memory at the slot's recomputed layers), recursively, while that shortens the task. A task only
gets shorter, so no slot gets longer and every rank keeps one task per slot.
"""

from __future__ import annotations

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
            return [_draft(pctx, start, half, part, task) for start, part in zip(starts, seqs)
                    if part]
    return None


def _fits(pctx: PlanContext, padded_tokens: int, degree: int, layers: int, mode: str,
          packed: bool) -> bool:
    """Whether a task of ``padded_tokens`` on ``degree`` ranks fits memory within ``layers``
    recomputed layers and, ``packed`` (more than one sequence), the pack budget."""
    if packed and pctx.pack_tokens and padded_tokens > pctx.pack_tokens:
        return False
    c = pctx.recompute_for(padded_tokens, degree, mode)
    return c is not None and c <= layers


def _draft(pctx: PlanContext, start: int, degree: int, seqs: list[int], task: Draft) -> Draft:
    new = pctx.draft(start, degree, seqs, task.recompute_layers)
    new.slot = task.slot
    return new
