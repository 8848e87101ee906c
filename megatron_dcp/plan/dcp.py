"""The DCP planner: DCP-inter (per-sequence degree, heterogeneous groups running at once, short
sequences packed, a different number of micro-steps per rank) and DCP-intra (per-task checkpoint
depth: the fewest recomputed layers that fit; a wider group where that needs less work).

One *pass* of the planner, for a degree floor ``f``, a target makespan ``M`` and a packing grain
``g``:

1. Degree per sequence: the smallest vocabulary size at which it fits memory, widened while that
   cuts its work (ranks x time) by at least ``MIN_WORK_SAVING`` (less recompute), and at least
   ``f`` (uniform wide groups fragment the ranks less when long sequences dominate).
2. Packing: sequences faster than ``g x M`` at their degree are packed (next-fit, longest first)
   into tasks of at most ``g x M`` seconds that fit memory.
3. Moldable list scheduling, longest task first: each task takes the smallest degree at which its
   earliest finish meets ``M``, on the vocabulary group of that size that frees first; tasks that
   meet ``M`` nowhere wait until the others are placed (short tasks fill the gaps first), then take
   the degree with the earliest finish (not wider than where work grows 30 %).
4. Back-to-back tasks of the same group are merged into one packed task when that is not slower
   (fine-grained balance, then the per-task cost paid once).

``M`` starts at ``max(longest sequence at its fastest degree, total work / ranks)``. The passes
of ``SEARCH_PASSES`` (fewer for large inputs, to stay within the latency budget) are tried and
the shortest plan is kept. For inputs up to ``BASELINE_CANDIDATE_LIMIT`` sequences x ranks, the
baselines' own plans, lightened by DCP-intra (fewest recomputed layers per task, barriers
dropped, same order: never longer), are candidates too, so DCP is never slower than a baseline
there by construction (unless ``pack_tokens`` is set: a baseline plan that packs beyond it is not
a candidate of ``dcp``/``dcp-inter``; ``dcp-intra`` keeps the bucket plan, which ignores
``pack_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Union

from megatron_dcp.plan.schedule import (BlockClock, Draft, PlanContext, lighten, retime,
                                        retime_slots)

OVERHEAD_TASKS = 2
"""Packed tasks are allowed to grow to this many times the fixed per-task cost."""
MAX_WORK_GROWTH = 1.3
"""A task is not widened past the degree where its work (ranks x time) grows by more than this."""
MIN_WORK_SAVING = 0.02
"""A sequence is widened for less recompute only when that cuts its work (ranks x time) by at
least this share: below it the wider group's fragmentation costs more than it saves."""
BASELINE_CANDIDATE_LIMIT = 20_000
"""Sequences x ranks up to which the baselines' plans join DCP's candidates."""


class SearchPass(NamedTuple):
    """One pass of the planner: a degree floor, a target makespan and a packing grain."""

    floor: Union[int, str]
    """Smallest degree of every sequence; ``"node"``: one node's ranks (uniform wide groups
    fragment the ranks less when long sequences dominate)."""
    target: float
    """Target makespan as a multiple of the lower bound (slack lets long tasks start early)."""
    grain: float
    """Sequences faster than ``grain x target`` are packed into tasks of at most that length."""


SEARCH_PASSES = (
    SearchPass("node", 1.0, 0.02), SearchPass(1, 1.0, 0.05), SearchPass(1, 1.05, 0.05),
    SearchPass(1, 1.03, 0.5), SearchPass("node", 1.0, 0.1), SearchPass(1, 1.0, 0.2),
    SearchPass(2, 1.0, 0.05), SearchPass(1, 1.03, 0.34), SearchPass(1, 1.2, 0.05),
    SearchPass(2, 1.2, 0.05), SearchPass(4, 1.3, 0.05), SearchPass(1, 1.3, 0.05),
)
"""The passes, most useful first (large inputs run only the first ones). No single setting is
best everywhere: a node-wide degree floor wins when long sequences dominate, small grains when
many short sequences must fill the gaps, target slack when one long sequence bounds the step.
The shortest plan over all passes is kept."""
LARGE_INPUT, LARGE_INPUT_PASSES = 10_000, 4
HUGE_INPUT, HUGE_INPUT_PASSES = 2_000_000, 2
LOCKSTEP_PASSES = (("node", 1.0, "min", False), ("node", 1.0, "min", True),
                   ("node", 1.0, "full", True), (1, 0.25, "min", False),
                   ("node", 1.0, "full", False), ("node", 0.5, "min", True),
                   (1, 0.5, "min", False), (1, 0.25, "full", False))
"""(degree floor, target factor, recompute, extend) of the lockstep passes
(`megatron_dcp.plan.lockstep`), most useful first: the target is the slot length a wide sequence
should stay within (a multiple of the lower bound); recompute ``full`` (every layer, where the
checkpoint policy is ``auto``) fits several times the tokens into a slot: fewer slots, where each
costs ZeRO-3's parameter all-gathers; ``extend`` lets a sequence lengthen a slot rather than open
one (better where few sequences are left over, worse where later ones would fill a new slot)."""
"""Sequences x ranks above which only the first passes run: the planner runs ahead of every
step and must stay within its latency budget (<= 1 s at 16,000 sequences on 1,024 ranks,
docs/BENCHMARKS.md), and every pass re-plans the whole batch."""


@dataclass(slots=True)
class SeqChoice:
    """One sequence and the degree, recompute depth and time chosen for it."""

    i: int
    length: int
    pairs: float
    degree: int = 0
    ckpt: int = 0
    time: float = 0.0
    fits: list[tuple[int, int]] = field(default_factory=list)
    """(degree, recompute depth) of every vocabulary size from ``degree`` on where it fits."""


@dataclass(slots=True)
class PackedTask:
    """Sequences packed into one task before it is placed."""

    seqs: list[int]
    tokens: int
    """Tokens after padding at ``degree``."""
    pairs: float
    degree: int
    """The smallest degree at which every sequence of the task fits."""
    time: float
    """Predicted seconds at ``degree``."""


def fill_options(ctx: PlanContext, info: SeqChoice, mode: str, start_at: int = 0) -> None:
    """Fill ``info.fits`` with (degree, ckpt) for every vocabulary size from ``start_at`` on."""
    for d in ctx.vocab.sizes:
        if d < start_at:
            continue
        c = ctx.recompute_for(ctx.padded(info.length, d), d, mode)
        if c is not None:
            info.fits.append((d, c))


def raised(ctx: PlanContext, info: SeqChoice, mode: str, floor: int) -> SeqChoice:
    """A copy of ``info`` at degree ``floor`` or more (fewer degrees mean less fragmentation)."""
    if info.degree >= floor:
        return info
    out = SeqChoice(info.i, info.length, info.pairs)
    for d in ctx.vocab.sizes:
        if d >= floor:
            c = ctx.recompute_for(ctx.padded(info.length, d), d, mode)
            if c is not None:
                out.degree, out.ckpt = d, c
                out.time = ctx.cm.best_time(info.length, info.pairs, d, c)[0]
                return out
    return info


def degree_choice(ctx: PlanContext, infos: list[SeqChoice], mode: str) -> tuple[float, float]:
    """Minimal degrees and times; returns (total work / ranks, longest fastest time)."""
    cm = ctx.cm
    sizes = ctx.vocab.sizes
    total = 0.0
    overhead = cm.task_overhead
    for info in infos:
        for d in sizes:
            c = ctx.recompute_for(ctx.padded(info.length, d), d, mode)
            if c is not None:
                info.degree, info.ckpt = d, c
                break
        info.time = cm.best_time(info.length, info.pairs, info.degree, info.ckpt)[0]
        if info.ckpt:
            # recompute costs work: more ranks (less recompute) may do the sequence with less work
            fill_options(ctx, info, mode, info.degree)
            work = info.degree * info.time
            for d, c in info.fits[1:]:
                t = cm.best_time(info.length, info.pairs, d, c)[0]
                if d * t < work * (1.0 - MIN_WORK_SAVING):
                    info.degree, info.ckpt, info.time, work = d, c, t, d * t
                if c == 0:
                    break  # no recompute left to save: wider groups only add communication
        total += info.degree * max(info.time - overhead, 0.0)
    per_rank = total / ctx.world
    longest = 0.0
    for info in sorted(infos, key=lambda x: -x.time):
        if info.time <= max(per_rank, longest):
            break  # its fastest time is at most its current time: cannot raise the bound
        if not info.fits:
            fill_options(ctx, info, mode, info.degree)
        fastest = info.time
        for d, c in info.fits:
            t = cm.best_time(info.length, info.pairs, d, c)[0]
            fastest = min(fastest, t)
        longest = max(longest, fastest)
    return per_rank, longest


def _pack(ctx: PlanContext, infos: list[SeqChoice], mode: str, limit: float
          ) -> list[PackedTask]:
    """Sequences whose time at their minimal degree is at most ``limit`` packed (next-fit,
    longest first) into tasks of up to ``limit`` seconds (and ``pack_tokens`` tokens when the
    config sets it); longer sequences become tasks of their own."""
    cm = ctx.cm
    token_cap = ctx.pack_tokens or float("inf")
    tasks: list[PackedTask] = []
    by_degree: dict[int, list[SeqChoice]] = {}
    for info in infos:
        if info.time > limit:
            tasks.append(PackedTask([info.i], ctx.padded(info.length, info.degree), info.pairs,
                                    info.degree, info.time))
        else:
            by_degree.setdefault(info.degree, []).append(info)
    for degree, items in by_degree.items():
        items.sort(key=lambda x: (-x.length, x.i))
        cur: Optional[PackedTask] = None
        for info in items:
            tokens = ctx.padded(info.length, degree)
            if cur is not None:
                new_tokens, new_pairs = cur.tokens + tokens, cur.pairs + info.pairs
                c = ctx.recompute_for(new_tokens, degree, mode) if new_tokens <= token_cap else None
                if c is not None:
                    t = cm.best_time(new_tokens, new_pairs, degree, c)[0]
                    if t <= limit:
                        cur.seqs.append(info.i)
                        cur.tokens, cur.pairs, cur.time = new_tokens, new_pairs, t
                        continue
                tasks.append(cur)
            cur = PackedTask([info.i], tokens, info.pairs, degree, info.time)
        if cur is not None:
            tasks.append(cur)
    return tasks


def _options_for(ctx: PlanContext, task: PackedTask, mode: str):
    """(degree, ckpt, time) of a packed task for every vocabulary degree from its minimum on."""
    lengths = ctx.lengths
    raw = task.tokens if task.degree == 1 else sum(lengths[s] for s in task.seqs)
    for d in ctx.vocab.sizes:
        if d < task.degree:
            continue
        padded_tokens = raw if d == 1 else ctx.padded_tokens(task.seqs, d)
        c = ctx.recompute_for(padded_tokens, d, mode)
        if c is None:
            continue
        t = task.time if d == task.degree else ctx.cm.best_time(raw, task.pairs, d, c)[0]
        yield d, c, t


def _build(ctx: PlanContext, tasks: list[PackedTask], mode: str, target: float
           ) -> list[Draft]:
    """Moldable list scheduling, longest first: each task on the smallest degree whose earliest
    finish meets ``target``, on the group of that size that frees first. Tasks that meet the target
    nowhere wait until all others are placed (so short tasks fill the gaps first), then take the
    degree with the earliest finish."""
    clock = BlockClock(ctx.vocab)
    drafts = []
    deferred = []

    def put(task: PackedTask, d: int, c: int, start_rank: int, at: float) -> None:
        draft = ctx.draft(start_rank, d, task.seqs, c)
        draft.start = at
        clock.occupy(start_rank, d, at + draft.duration)
        drafts.append(draft)

    for task in sorted(tasks, key=lambda t: (-t.time, t.seqs[0])):
        work = None
        for d, c, t in _options_for(ctx, task, mode):
            start_rank, at = clock.peek(d)
            if at + t <= target:
                put(task, d, c, start_rank, at)
                break
            if work is None:
                work = d * t
            elif d * t > MAX_WORK_GROWTH * work:
                deferred.append(task)
                break
        else:
            deferred.append(task)
    for task in sorted(deferred, key=lambda t: (-t.time, t.seqs[0])):
        best = None
        work = None
        for d, c, t in _options_for(ctx, task, mode):
            if work is None:
                work = d * t
            elif d * t > MAX_WORK_GROWTH * work:
                break  # wider groups would waste more than they save
            start_rank, at = clock.peek(d)
            if best is None or at + t < best[0]:
                best = (at + t, d, c, start_rank, at)
        put(task, *best[1:])
    drafts.sort(key=lambda d: (d.start, d.start_rank))
    return drafts


def _merge_runs(ctx: PlanContext, drafts: list[Draft], mode: str) -> list[Draft]:
    """Merge back-to-back tasks of the same group into one packed task where that is not slower
    (scheduling fine-grained, then packing what landed together, saves the per-task cost without
    losing balance). ``drafts`` must be in start order; returns them in the same order."""
    last: list[Optional[int]] = [None] * ctx.world  # index into ``out`` of each rank's last task
    out: list[Draft] = []
    for d in drafts:
        a, b = d.start_rank, d.start_rank + d.size
        k = last[a]
        prev = out[k] if k is not None else None
        if prev is not None and prev.start_rank == a and prev.size == d.size and \
                all(last[r] == k for r in range(a, b)):
            seqs = prev.seqs + d.seqs
            tokens = ctx.padded_tokens(seqs, d.size)
            fits_cap = tokens <= (ctx.pack_tokens or tokens)
            c = ctx.recompute_for(tokens, d.size, mode) if fits_cap else None
            if c is not None:
                merged = ctx.draft(a, d.size, seqs, c)
                if merged.duration <= prev.duration + d.duration:
                    merged.start = prev.start
                    out[k] = merged
                    continue
        out.append(d)
        for r in range(a, b):
            last[r] = len(out) - 1
    return out


def _passes(ctx: PlanContext) -> list[tuple[int, float, float]]:
    """(degree floor, target factor, grain) of the passes this input gets (see SEARCH_PASSES)."""
    rpn = ctx.vocab.ranks_per_node
    passes = [(rpn if p.floor == "node" else p.floor, p.target, p.grain) for p in SEARCH_PASSES]
    passes = [p for p in passes if p[0] in ctx.vocab.sizes]
    size = len(ctx.active) * ctx.world
    if size > HUGE_INPUT:
        return passes[:HUGE_INPUT_PASSES]
    return passes[:LARGE_INPUT_PASSES] if size > LARGE_INPUT else passes


def _lockstep_passes(ctx: PlanContext, mode: str) -> list[tuple[int, float, str, bool]]:
    """(degree floor, target factor, recompute mode, extend) of the lockstep passes this input
    gets."""
    rpn = ctx.vocab.ranks_per_node
    passes = [(rpn if floor == "node" else floor, factor, mode if depth == "min" else depth, ext)
              for floor, factor, depth, ext in LOCKSTEP_PASSES if depth == "min" or mode == "min"]
    passes = [p for p in passes if p[0] in ctx.vocab.sizes]
    size = len(ctx.active) * ctx.world
    if size > HUGE_INPUT:
        return passes[:HUGE_INPUT_PASSES]
    return passes[:LARGE_INPUT_PASSES] if size > LARGE_INPUT else passes


def plan_dcp(ctx: PlanContext, inter: bool = True, intra: bool = True,
             baselines: Optional[dict[str, Callable[[PlanContext], list[Draft]]]] = None,
             lockstep: bool = False) -> tuple[list[Draft], str, dict[str, float]]:
    """DCP drafts, the name of the candidate that won (``dcp(...)`` or ``<baseline>+intra``) and
    every candidate's predicted makespan. ``lockstep``: every candidate in slots
    (`megatron_dcp.plan.lockstep`)."""
    # imported here: the lockstep builder reuses this module's degree choice
    from megatron_dcp.plan.lockstep import lockstep_pass, to_slots

    mode = ctx.dcp_mode() if intra else ctx.baseline_mode()
    candidates: list[tuple[float, str, list[Draft]]] = []
    if inter:
        infos = [SeqChoice(i, ctx.lengths[i], ctx.pairs[i]) for i in ctx.active]
        per_rank, longest = degree_choice(ctx, infos, mode)
        bound = max(per_rank, longest)
        full = None
        for floor, factor, depth, extend in _lockstep_passes(ctx, mode) if lockstep else ():
            use = infos
            if depth != mode:
                if full is None:
                    full = [SeqChoice(i, ctx.lengths[i], ctx.pairs[i]) for i in ctx.active]
                    degree_choice(ctx, full, depth)
                use = full
            if floor > 1:
                use = [raised(ctx, info, depth, floor) for info in use]
            drafts = lockstep_pass(ctx, use, depth, max(bound * factor, longest), extend)
            makespan = retime_slots(drafts, ctx.cm)
            name = f"lockstep(floor={floor},M={factor},ckpt={depth}{',extend' if extend else ''})"
            candidates.append((makespan, name, drafts))
        for floor, factor, grain in () if lockstep else _passes(ctx):
            target = max(bound * factor, longest)
            use = infos if floor == 1 else [raised(ctx, info, mode, floor) for info in infos]
            # tasks of at least OVERHEAD_TASKS x the fixed per-task cost keep that cost small
            limit = max(grain * target, OVERHEAD_TASKS * ctx.cm.task_overhead)
            drafts = _merge_runs(ctx, _build(ctx, _pack(ctx, use, mode, limit), mode, target), mode)
            makespan = retime(drafts, ctx.world, barriers=False)
            candidates.append((makespan, f"dcp(floor={floor},M={factor},g={grain})", drafts))
    if inter and len(ctx.active) * ctx.world > BASELINE_CANDIDATE_LIMIT:
        baselines = {}  # large inputs: the planner's latency budget has no room for them
    for name, planner in (baselines or {}).items():
        drafts = planner(ctx)
        # DCP-inter has its own candidates, so a baseline plan that packs beyond the configured
        # token budget is dropped; DCP-intra alone keeps the bucket plan as the bucket policy does
        if inter and ctx.pack_tokens and any(len(d.seqs) > 1 and d.tokens > ctx.pack_tokens
                                             for d in drafts):
            continue
        if intra:
            drafts = lighten(ctx, drafts)
        if lockstep:
            drafts = to_slots(ctx, drafts)
            makespan = retime_slots(drafts, ctx.cm)
        else:
            makespan = retime(drafts, ctx.world, barriers=False if inter else "rounds")
        candidates.append((makespan, f"{name}+intra" if intra else name, drafts))
    candidates.sort(key=lambda c: c[0])  # stable: ties keep the pass order
    _, name, drafts = candidates[0]
    return drafts, name, {c[1]: round(c[0], 6) for c in candidates}
