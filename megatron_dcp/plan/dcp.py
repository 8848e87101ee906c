"""The DCP planner: DCP-inter (per-sequence degree, packing, heterogeneous groups, per-rank number of
micro-steps) and DCP-intra (per-task checkpoint depth).

Algorithm (one pass for a target makespan ``M`` and a packing grain ``g``; a few (M, g) pairs are
tried and the shortest plan is kept):

1. Per sequence, the smallest vocabulary degree at which it fits memory (with the fewest recomputed
   layers under DCP-intra, full recompute under DCP-inter alone).
2. A sequence whose time at that degree exceeds ``M`` gets the smallest larger degree at which it
   takes at most ``M`` (or its fastest degree): long sequences must not set the critical path.
3. Within each degree, sequences are packed (next-fit, longest first) into tasks of at most
   ``g x M`` predicted seconds and the memory budget: packing amortises the per-task cost of short
   sequences, the grain keeps tasks small enough to balance.
4. Tasks are placed largest degree first, longest first (LPT), each on the vocabulary group of its
   size that frees first; its start is when all its ranks are free. Ranks end up with different
   numbers of tasks; one gradient reduction ends the step.

``M`` starts at the lower bound ``max(longest sequence at its fastest degree, total work / ranks)``.
Finally the baselines' plans, lightened by DCP-intra (fewest recomputed layers per task, barriers
dropped, same order, which can only make them shorter), join the candidates, so DCP is never slower
than a baseline under the cost model.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron_dcp.plan.schedule import BlockClock, Draft, PlanContext, lighten, padded, retime


class _SeqInfo:
    __slots__ = ("i", "length", "pairs", "degree", "ckpt", "time", "fits")

    def __init__(self, i: int, length: int, pairs: float) -> None:
        self.i, self.length, self.pairs = i, length, pairs
        self.degree, self.ckpt, self.time = 0, 0, 0.0
        self.fits: list[tuple[int, int]] = []


def _options(ctx: PlanContext, info: _SeqInfo, mode: str, start_at: int = 0) -> None:
    """Fill ``info.fits`` with (degree, ckpt) for every vocabulary size from ``start_at`` on."""
    for d in ctx.vocab.sizes:
        if d < start_at:
            continue
        c = ctx.ckpt_for(padded(info.length, d), d, mode)
        if c is not None:
            info.fits.append((d, c))


def _degree_choice(ctx: PlanContext, infos: list[_SeqInfo], mode: str) -> tuple[float, float]:
    """Minimal degrees and times; returns (total work / ranks, longest fastest time)."""
    cm = ctx.cm
    sizes = ctx.vocab.sizes
    total = 0.0
    overhead = cm.task_overhead
    for info in infos:
        for d in sizes:
            c = ctx.ckpt_for(padded(info.length, d), d, mode)
            if c is not None:
                info.degree, info.ckpt = d, c
                break
        info.time = cm.best_time(info.length, info.pairs, info.degree, info.ckpt)[0]
        total += info.degree * max(info.time - overhead, 0.0)
    per_rank = total / ctx.world
    longest = 0.0
    for info in infos:
        if info.time > per_rank * 0.5 or info.time > longest:
            _options(ctx, info, mode, info.degree)
            best = min(cm.best_time(info.length, info.pairs, d, c)[0] for d, c in info.fits)
            longest = max(longest, best)
    return per_rank, longest


def _build(ctx: PlanContext, infos: list[_SeqInfo], mode: str, target: float, grain: float) -> list[Draft]:
    cm = ctx.cm
    by_degree: dict[int, list[tuple[_SeqInfo, int, int]]] = {}
    for info in infos:
        degree, ckpt = info.degree, info.ckpt
        if info.time > target:
            if not info.fits:
                _options(ctx, info, mode, info.degree)
            best = None
            for d, c in info.fits:
                t = cm.best_time(info.length, info.pairs, d, c)[0]
                if best is None or t < best[0]:
                    best = (t, d, c)
                if t <= target:
                    best = (t, d, c)
                    break
            degree, ckpt = best[1], best[2]
        by_degree.setdefault(degree, []).append((info, degree, ckpt))
    limit = grain * target
    tasks: list[tuple[int, float, list[int], int]] = []
    for degree, items in by_degree.items():
        items.sort(key=lambda x: (-x[0].length, x[0].i))
        cap = cm.max_tokens(degree, 0) if mode == "min" else None
        seqs: list[int] = []
        tokens = pairs = 0.0
        ckpt = 0
        time = 0.0
        for info, _, c in items:
            new_tokens = tokens + padded(info.length, degree)
            if seqs:
                c_new = ctx.ckpt_for(int(new_tokens), degree, mode) if (cap is None or new_tokens > cap) else 0
                if c_new is not None:
                    t_new = cm.best_time(new_tokens, pairs + info.pairs, degree, c_new)[0]
                    if t_new <= limit:
                        seqs.append(info.i)
                        tokens, pairs, ckpt, time = new_tokens, pairs + info.pairs, c_new, t_new
                        continue
                tasks.append((degree, time, seqs, ckpt))
            seqs = [info.i]
            tokens, pairs, ckpt = float(padded(info.length, degree)), info.pairs, c
            time = cm.best_time(tokens, pairs, degree, ckpt)[0]
        if seqs:
            tasks.append((degree, time, seqs, ckpt))
    tasks.sort(key=lambda t: (-t[0], -t[1], t[2][0]))
    clock = BlockClock(ctx.vocab)
    drafts = []
    for degree, time, seqs, ckpt in tasks:
        d = ctx.draft(0, degree, seqs, ckpt)
        d.start_rank, d.start = clock.place(degree, d.duration)
        drafts.append(d)
    drafts.sort(key=lambda d: (d.start, d.start_rank))
    return drafts


def plan_dcp(ctx: PlanContext, inter: bool = True, intra: bool = True,
             baselines: Optional[dict[str, Callable[[PlanContext], list[Draft]]]] = None
             ) -> tuple[list[Draft], str]:
    """DCP drafts and the name of the candidate that won (``dcp`` or ``<baseline>+intra``)."""
    mode = ctx.dcp_mode() if intra else ctx.baseline_mode()
    candidates: list[tuple[float, str, list[Draft]]] = []
    if inter:
        infos = [_SeqInfo(i, ctx.lengths[i], ctx.pairs[i]) for i in ctx.active]
        per_rank, longest = _degree_choice(ctx, infos, mode)
        bound = max(per_rank, longest)
        tried = set()
        for factor, grain in ((1.0, 0.25), (1.0, 0.1), (0.7, 0.25), (1.0, 0.5)):
            target = max(bound * factor, longest)
            key = (round(target, 12), grain)
            if key in tried:
                continue
            tried.add(key)
            drafts = _build(ctx, infos, mode, target, grain)
            candidates.append((retime(drafts, ctx.world, barriers=False), f"dcp(M={factor},g={grain})", drafts))
            if len(ctx.active) * ctx.world > 2_000_000:
                break  # very large inputs: one pass keeps the planner within its latency budget
    for name, planner in (baselines or {}).items():
        drafts = planner(ctx)
        if intra:
            drafts = lighten(ctx, drafts)
        makespan = retime(drafts, ctx.world, barriers=False if inter else "rounds")
        candidates.append((makespan, f"{name}+intra" if intra else name, drafts))
    candidates.sort(key=lambda c: c[0])
    _, name, drafts = candidates[0]
    return drafts, name
