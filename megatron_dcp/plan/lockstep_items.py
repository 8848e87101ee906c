"""The items of a lockstep pass (`megatron_dcp.plan.lockstep`): what joins a slot as one unit.

An item is a `Pack`: one sequence, or short sequences of one degree packed into a group
(`next_fit`: a floor pass raises thousands of short sequences to one node's ranks; packed, each
group joins a slot in one step), with the degree and recomputed layers it runs at.
`lockstep_items` splits a pass's sequences into the *wide or deep* items (a degree above 1, or
more recompute than the short ones: they open and join slots) and the *short* ones (one rank,
the base recomputed layers: they fill what the wide ones leave), longest first.
"""

from __future__ import annotations

from typing import Callable, Sequence

from megatron_dcp.plan.choices import (MAX_WORK_GROWTH, OVERHEAD_TASKS, Pack, SeqChoice,
                                       fill_options, next_fit)
from megatron_dcp.plan.drafts import PlanContext

GRAIN_TOKENS, TAIL = 0.02, 2.0
"""Wide items are packed (`next_fit`) into groups of up to ``GRAIN_TOKENS`` x the tokens a task
of their degree holds at their recomputed layers (memory binds where short sequences fill a
slot: coarser groups leave it unused), and each group within 1 / (``TAIL`` x the groups of its
degree side by side in a slot) of the time and tokens of the items after it (the last ones stay
fine enough to fill what the groups leave)."""
PACK_FROM = 2000
"""Wide items are packed where a pass has more of them than this (where joining them one by one
sets the planning time; below it, packing saves little time and can cost a little balance)."""


def choose(pctx: PlanContext, info: SeqChoice, mode: str, target: float, base: int
           ) -> SeqChoice:
    """The choice for slots of a wide or deep sequence at its pass's choice ``info`` (a degree
    above 1, or more recompute than ``base``: `lockstep_items`): the smallest degree at which it
    finishes within ``target`` without recompute beyond ``base`` (a deeper slot makes every task
    in it recompute), else the smallest at which it finishes within ``target``, else the fastest
    before work grows by `MAX_WORK_GROWTH`; with the options from that degree on (where known)."""
    if not info.fitting_options:
        if info.recompute_layers <= base and info.duration <= target:
            return SeqChoice(info.i, info.length, info.pairs, info.degree, info.recompute_layers,
                             info.duration)
        fill_options(pctx, info, mode, info.degree)
    options = info.fitting_options
    for d, c in options:
        if c <= base:
            t = pctx.seq_time(info.length, info.pairs, d, c)
            if t <= target:
                return SeqChoice(info.i, info.length, info.pairs, d, c, t, _from(options, d))
            break
    best, work = info, None
    for d, c in options:
        t = pctx.seq_time(info.length, info.pairs, d, c)
        if work is None:
            work = d * t
        elif d * t > MAX_WORK_GROWTH * work:
            break
        if t <= target or best is info or t < best.duration:
            best = SeqChoice(info.i, info.length, info.pairs, d, c, t)
        if t <= target:
            break
    return SeqChoice(info.i, info.length, info.pairs, best.degree, best.recompute_layers,
                     best.duration, _from(options, best.degree))


def _from(options: Sequence[tuple[int, int]], degree: int) -> list[tuple[int, int]]:
    """The ``options`` (smallest degree first) from ``degree`` on."""
    return [f for f in options if f[0] >= degree]


def _longest_first(item: Pack) -> tuple[float, int]:
    return -item.duration, item.seqs[0]


def lockstep_items(pctx: PlanContext, same: Sequence[Sequence[SeqChoice]], mode: str,
                   target: float, grain: float, lift: Callable[[SeqChoice], SeqChoice]
                   ) -> tuple[list[Pack], list[Pack]]:
    """The wide or deep items and the short ones of a pass, longest first: each sequence at
    ``lift`` of its `degree_choice` (raised to the pass's floor, or its choice under recompute
    ``full`` from the floor on), its degree chosen by `choose` for slots of ``target`` seconds
    where it is wide or deep; ``grain`` > 0: wide items of at most ``grain x target`` seconds
    packed (`next_fit`). ``same``: the sequences' choices grouped by length and choice (one
    `choose` per group)."""
    base = pctx.cm.model.num_layers if mode == "full" else 0
    wide, short = [], []
    for group in same:
        info = lift(group[0])
        is_short = info.degree <= 1 and info.recompute_layers <= base
        chosen = info if is_short else choose(pctx, info, mode, target, base)
        options = None if is_short else chosen.fitting_options or None
        for x in group:
            (short if is_short else wide).append(Pack(
                [x.i], x.length, x.pairs, 1 if is_short else chosen.degree,
                chosen.recompute_layers, chosen.duration, fitting_options=options))
    wide.sort(key=_longest_first)
    if grain > 0 and len(wide) > PACK_FROM:
        # groups of at least OVERHEAD_TASKS x the fixed per-task cost keep that cost small
        limit = max(grain * target, OVERHEAD_TASKS * pctx.cm.time_model.task_overhead)
        wide = next_fit(pctx, wide, mode, limit, TAIL, GRAIN_TOKENS)
        wide.sort(key=_longest_first)
    short.sort(key=_longest_first)
    return wide, short
