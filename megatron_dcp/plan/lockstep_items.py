"""The items of a lockstep pass (`megatron_dcp.plan.lockstep`): what joins a slot as one unit.

An item is one sequence, or short sequences of one degree packed into a group (`pack_wide`: a
floor pass raises thousands of short sequences to one node's ranks; packed, each group joins a
slot in one step), with the degree and recomputed layers it runs at. `lockstep_items` splits a
pass's sequences into the *wide or deep* items (a degree above 1, or more recompute than the
short ones: they open and join slots) and the *short* ones (one rank, the base recomputed
layers: they fill what the wide ones leave), longest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from megatron_dcp.plan.choices import MAX_WORK_GROWTH, OVERHEAD_TASKS, SeqChoice, fill_options
from megatron_dcp.plan.drafts import PlanContext

GRAIN_TOKENS, TAIL = 0.02, 2.0
"""`pack_wide` groups items up to ``GRAIN_TOKENS`` x the tokens a task of their degree holds at
their recomputed layers (memory binds where short sequences fill a slot: coarser groups leave it
unused), and each group within 1 / (``TAIL`` x the groups of its degree side by side in a slot)
of the time and tokens of the items after it (the last ones stay fine enough to fill what the
groups leave)."""
PACK_FROM = 2000
"""`pack_wide` runs where a pass has more wide items than this (where joining them one by one
sets the planning time; below it, packing saves little time and can cost a little balance)."""


@dataclass(eq=False, slots=True)
class Item:
    """Sequences that join a slot together, with the degree and recomputed layers they run at
    and their ``duration`` there (seconds)."""

    seqs: list[int]
    tokens: int
    """Tokens of ``seqs`` before padding."""
    pairs: float
    degree: int
    recompute_layers: int
    duration: float
    choices: Optional[list[tuple[int, int]]] = None
    """(degree, fewest recomputed layers) of every vocabulary size from ``degree`` on where the
    item fits, smallest first; ``None``: not known (`options` finds them as asked)."""
    _padded: Optional[dict[int, int]] = field(default=None, repr=False)

    def padded(self, pctx: PlanContext, degree: int) -> int:
        """Tokens after padding on ``degree`` ranks (of a group: kept per degree)."""
        if len(self.seqs) == 1:
            return pctx.padded(self.tokens, degree)
        if self._padded is None:
            self._padded = {}
        found = self._padded.get(degree)
        if found is None:
            found = self._padded[degree] = pctx.padded_tokens(self.seqs, degree)
        return found

    def options(self, pctx: PlanContext, mode: str) -> Iterator[tuple[int, int]]:
        """`choices`, or where they are not known, the same found as asked (a caller mostly
        takes the first)."""
        if self.choices is not None:
            yield from self.choices
            return
        for d in pctx.vocab.sizes:
            if d >= self.degree:
                c = pctx.recompute_for(self.padded(pctx, d), d, mode)
                if c is not None:
                    yield d, c


def choose(pctx: PlanContext, info: SeqChoice, mode: str, target: float, base: int
           ) -> tuple[bool, int, int, float, Optional[list[tuple[int, int]]]]:
    """(whether the sequence is wide or deep, degree, recomputed layers, duration, options) of a
    sequence at its pass's choice ``info``: a short one keeps it; a wide or deep one takes the
    smallest degree at which it finishes within ``target`` without recompute beyond ``base`` (a
    deeper slot makes every task in it recompute), else the smallest at which it finishes within
    ``target``, else the fastest before work grows by `MAX_WORK_GROWTH`."""
    if info.degree <= 1 and info.recompute_layers <= base:
        return False, 1, info.recompute_layers, info.duration, None
    if not info.fitting_options:
        if info.recompute_layers <= base and info.duration <= target:
            return True, info.degree, info.recompute_layers, info.duration, None
        fill_options(pctx, info, mode, info.degree)
    options = info.fitting_options
    for d, c in options:
        if c <= base:
            t = pctx.seq_time(info.length, info.pairs, d, c)
            if t <= target:
                return True, d, c, t, _from(options, d)
            break
    best, work = None, None
    for d, c in options:
        t = pctx.seq_time(info.length, info.pairs, d, c)
        if work is None:
            work = d * t
        elif d * t > MAX_WORK_GROWTH * work:
            break
        if t <= target:
            best = (d, c, t)
            break
        if best is None or t < best[2]:
            best = (d, c, t)
    d, c, t = best or (info.degree, info.recompute_layers, info.duration)
    return True, d, c, t, _from(options, d)


def _from(options: Sequence[tuple[int, int]], degree: int) -> list[tuple[int, int]]:
    """The ``options`` (smallest degree first) from ``degree`` on."""
    return [f for f in options if f[0] >= degree]


def _longest_first(item: Item) -> tuple[float, int]:
    return -item.duration, item.seqs[0]


def pack_wide(pctx: PlanContext, items: list[Item], mode: str, limit: float) -> list[Item]:
    """Wide items (one sequence each, longest first) of at most ``limit`` seconds, packed per
    degree and recomputed layers (next-fit, longest first) into groups of up to ``limit`` seconds
    that fit memory at those layers, ``pack_tokens``, and the bounds of `GRAIN_TOKENS` and
    `TAIL`. Longer items, and groups of one, stay as they are."""
    out: list[Item] = []
    kinds: dict[tuple[int, int], list[Item]] = {}
    for item in items:
        if item.duration > limit:
            out.append(item)
        else:  # each kind's items stay longest first
            kinds.setdefault((item.degree, item.recompute_layers), []).append(item)
    cap, overhead = pctx.pack_tokens or math.inf, pctx.cm.time_model.task_overhead
    for (d, c), same in kinds.items():
        fine = TAIL * pctx.world / d
        most_tokens = GRAIN_TOKENS * d * pctx.cm.memory_model.max_local_tokens(c)
        # time (less the fixed per-task cost) and tokens the items after each one add
        time_after, tokens_after = [0.0] * (len(same) + 1), [0] * (len(same) + 1)
        for k in range(len(same) - 1, -1, -1):
            time_after[k] = time_after[k + 1] + max(same[k].duration - overhead, 0.0)
            tokens_after[k] = tokens_after[k + 1] + same[k].padded(pctx, d)
        group, padded, tokens, pairs = [same[0]], same[0].padded(pctx, d), same[0].tokens, \
            same[0].pairs
        for k in range(1, len(same) + 1):
            if k < len(same):
                item = same[k]
                more = padded + item.padded(pctx, d)
                c_more = pctx.recompute_for(more, d, mode) \
                    if more <= min(cap, most_tokens, tokens_after[k + 1] / fine) else None
                if c_more is not None and c_more <= c and pctx.seq_time(
                        tokens + item.tokens, pairs + item.pairs, d, c) <= \
                        min(limit, time_after[k + 1] / fine):
                    group.append(item)
                    padded, tokens, pairs = more, tokens + item.tokens, pairs + item.pairs
                    continue
            out.append(group[0] if len(group) == 1 else Item(
                [s for x in group for s in x.seqs], tokens, pairs, d, c,
                pctx.seq_time(tokens, pairs, d, c)))
            if k < len(same):
                group, padded, tokens, pairs = [same[k]], same[k].padded(pctx, d), \
                    same[k].tokens, same[k].pairs
    return out


def lockstep_items(pctx: PlanContext, same: Sequence[Sequence[SeqChoice]], mode: str,
                   target: float, grain: float, lift: Callable[[SeqChoice], SeqChoice]
                   ) -> tuple[list[Item], list[Item]]:
    """The wide or deep items and the short ones of a pass, longest first: each sequence at
    ``lift`` of its `degree_choice` (raised to the pass's floor, or its choice under recompute
    ``full`` from the floor on), its degree chosen by `choose` for slots of ``target`` seconds;
    ``grain`` > 0: wide items of at most ``grain x target`` seconds packed (`pack_wide`).
    ``same``: the sequences' choices grouped by length and choice (one `choose` per group)."""
    base = pctx.cm.model.num_layers if mode == "full" else 0
    wide, short = [], []
    for group in same:
        is_wide, d, c, t, options = choose(pctx, lift(group[0]), mode, target, base)
        for info in group:
            item = Item([info.i], info.length, info.pairs, d, c, t, options)
            (wide if is_wide else short).append(item)
    wide.sort(key=_longest_first)
    if grain > 0 and len(wide) > PACK_FROM:
        # groups of at least OVERHEAD_TASKS x the fixed per-task cost keep that cost small
        wide = pack_wide(pctx, wide, mode, max(grain * target, OVERHEAD_TASKS *
                                               pctx.cm.time_model.task_overhead))
        wide.sort(key=_longest_first)
    short.sort(key=_longest_first)
    return wide, short
