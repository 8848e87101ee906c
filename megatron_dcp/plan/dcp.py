"""The free passes of the DCP planner: DCP-inter (per-sequence degree, heterogeneous groups
running at once, short sequences packed, a different number of micro-steps per rank) with
DCP-intra (per task: the fewest recomputed layers that fit; a wider group where
that needs less work). `megatron_dcp.plan.planners.plan_dcp` runs them as candidates.

One *pass*, for a degree floor ``f``, a target makespan ``M`` and a packing grain ``g``:

1. Degree per sequence (`megatron_dcp.plan.choices.degree_choice`): the smallest vocabulary size
   at which it fits memory, widened where that cuts its work (ranks x time) by at least
   ``MIN_WORK_SAVING`` (less recompute; past the first degree without recompute, until every
   layout kind has been seen without it: Ulysses may first appear at a wider degree), and at
   least ``f`` (uniform wide groups fragment the ranks less when long sequences dominate).
2. Packing: sequences faster than ``g x M`` at their degree are packed (next-fit, longest first)
   into tasks of at most ``g x M`` seconds that fit memory.
3. Moldable list scheduling, longest task first: each task takes the smallest degree at which its
   earliest finish meets ``M``, on the vocabulary group of that size that frees first; tasks that
   meet ``M`` nowhere wait until the others are placed (short tasks fill the gaps first), then take
   the degree with the earliest finish (not wider than where work grows 30 %).
4. Back-to-back tasks of the same group are merged into one packed task when that is not slower
   (fine-grained balance, then the per-task cost paid once).

``M`` starts at ``max(longest sequence at its fastest degree, total work / ranks)``. The passes
of ``SEARCH_PASSES`` (fewer for large inputs, to stay within the latency budget) are tried.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterator, NamedTuple, Optional, Union

from megatron_dcp.plan.choices import (MAX_WORK_GROWTH, OVERHEAD_TASKS, Pack, SeqChoice,
                                       floor_of, next_fit, passes_for, raised)
from megatron_dcp.plan.drafts import BlockClock, Candidate, Draft, PlanContext, retime


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
    SearchPass("node", 1.03, 0.1), SearchPass("node", 1.03, 0.02),
)
"""The passes, most useful first (large inputs run only the first ones). No single setting is
best everywhere: a node-wide degree floor wins when long sequences dominate, small grains when
many short sequences must fill the gaps, target slack when one long sequence bounds the step.
The shortest plan over all passes is kept."""


def _sequences(pctx: PlanContext, infos: list[SeqChoice]) -> list[Pack]:
    """The sequences at their choices ``infos`` as packs of one, longest first (`next_fit`'s
    order; the passes of one degree floor share them: `next_fit` changes no pack it is given)."""
    padded, n = pctx.padded, len(pctx.lengths)
    return [Pack([x.i], x.length, x.pairs, x.degree, x.recompute_layers, x.duration,
                 padded_tokens=padded(x.length, x.degree))
            for x in sorted(infos, key=lambda x: x.i - x.length * n)]  # (-length, i)


def _pack(pctx: PlanContext, seqs: list[Pack], mode: str, limit: float) -> list[Pack]:
    """The sequences ``seqs`` (`_sequences`) of at most ``limit`` seconds packed (`next_fit`)
    into tasks of up to ``limit`` seconds, each timed at its best layout. The lockstep passes
    pack their items with `next_fit` too, but per degree and recomputed layers (a slot's tasks
    share them), and bound by a slot's share."""
    packs = next_fit(pctx, seqs, mode, limit)
    for p in packs:
        if p.layout is None:
            p.layout = pctx.seq_best(p.tokens, p.pairs, p.degree, p.recompute_layers)[1]
    return packs


def _options_for(pctx: PlanContext, task: Pack, mode: str) -> Iterator[Pack]:
    """A packed task at every vocabulary degree from its minimum on where it fits, timed at its
    best layout."""
    yield task
    for d in pctx.vocab.sizes:
        if d <= task.degree:
            continue
        c = pctx.recompute_for(pctx.padded_tokens(task.seqs, d), d, mode)
        if c is not None:
            yield Pack(task.seqs, task.tokens, task.pairs, d, c,
                       *pctx.cm.time_model.best_time(task.tokens, task.pairs, d, c))


class Placement(NamedTuple):
    """Where and when a task starts earliest (`_build`)."""

    start_rank: int
    start: float
    hole: Optional[int]
    """The idle interval it runs in (`Holes`); ``None``: when all its group's ranks are free."""


class Hole(NamedTuple):
    """Ranks ``[first, end)`` idle from ``free`` until ``busy`` (seconds; `Holes`)."""

    first: int
    end: int
    free: float
    busy: float


class Holes:
    """Idle intervals the list scheduler leaves: a task placed on a group waits until all its
    ranks are free, and ranks that freed earlier idle until it starts. A later (shorter) task of
    a vocabulary group inside such an interval can run there without delaying anything
    (backfilling). Each hole is a `Hole`; ranks whose free times differ form separate holes."""

    def __init__(self, vocab, min_length: float) -> None:
        self.vocab = vocab
        self.min_length = min_length
        """Shorter holes are not kept (nothing worth placing fits them)."""
        self.holes: list[Hole] = []

    def record(self, avail: list[float], start: int, size: int, at: float) -> None:
        """Ranks ``[start, start + size)`` (free times ``avail``) get a task at ``at``."""
        r = start
        end = start + size
        while r < end:
            free = avail[r]
            q = r + 1
            while q < end and avail[q] == free:
                q += 1
            if at - free > self.min_length:
                self.holes.append(Hole(r, q, free, at))
            r = q

    def find(self, size: int, duration: float) -> Optional[Placement]:
        """The earliest hole where a vocabulary group of ``size`` ranks can run ``duration``
        seconds; ``None``: no hole fits."""
        best = None
        starts = None
        for k, hole in enumerate(self.holes):
            free = hole.free
            if hole.busy - free < duration or hole.end - hole.first < size \
                    or (best and free >= best.start):
                continue
            if starts is None:
                starts = self.vocab.first_ranks(size)
            j = bisect_left(starts, hole.first)  # the first group from it on (starts ascend)
            if j < len(starts) and starts[j] + size <= hole.end:
                best = Placement(starts[j], free, k)
        return best

    def take(self, k: int, start: int, size: int, end: float) -> None:
        """Hole ``k`` runs a task on ``[start, start + size)`` until ``end``: what is left of it
        stays a hole (the ranks beside the task, and the task's ranks after it)."""
        hole = self.holes.pop(k)
        busy = hole.busy
        for left in (Hole(hole.first, start, hole.free, busy),
                     Hole(start + size, hole.end, hole.free, busy),
                     Hole(start, start + size, end, busy)):
            if left.end > left.first and busy - left.free > self.min_length:
                self.holes.append(left)


def _build(pctx: PlanContext, tasks: list[Pack], mode: str, target: float
           ) -> list[Draft]:
    """Moldable list scheduling, longest first: each task on the smallest degree whose earliest
    finish meets ``target``, on the group of that size that frees first or in an idle interval
    an earlier task left (`Holes`). Tasks that meet the target nowhere wait until all others are
    placed (so short tasks fill the gaps first), then take the degree with the earliest finish."""
    clock = BlockClock(pctx.vocab)
    holes = Holes(pctx.vocab, 1e-3 * target)
    drafts = []
    deferred = []

    def earliest(option: Pack) -> Placement:
        start_rank, at = clock.peek(option.degree)
        found = holes.find(option.degree, option.duration) if holes.holes else None
        return found if found is not None and found.start < at else Placement(start_rank, at, None)

    def put(option: Pack, at: Placement) -> None:
        draft = Draft(at.start_rank, option.degree, list(option.seqs), option.recompute_layers,
                      option.layout, option.duration, tokens=option.tokens, pairs=option.pairs,
                      start=at.start)
        if at.hole is None:
            holes.record(clock.avail, at.start_rank, option.degree, at.start)
            clock.occupy(at.start_rank, option.degree, at.start + draft.duration)
        else:
            holes.take(at.hole, at.start_rank, option.degree, at.start + draft.duration)
        drafts.append(draft)

    for task in sorted(tasks, key=lambda t: (-t.duration, t.seqs[0])):
        work, tried = None, []  # its options up to where work grows too much
        for option in _options_for(pctx, task, mode):
            at = earliest(option)
            if at.start + option.duration <= target:
                put(option, at)
                break
            if work is None:
                work = option.degree * option.duration
            elif option.degree * option.duration > MAX_WORK_GROWTH * work:
                deferred.append((task, tried))  # wider groups would waste more than they save
                break
            tried.append(option)
        else:
            deferred.append((task, tried))
    for task, tried in sorted(deferred, key=lambda x: (-x[0].duration, x[0].seqs[0])):
        best, best_at = tried[0], earliest(tried[0])
        for option in tried[1:]:
            at = earliest(option)
            if at.start + option.duration < best_at.start + best.duration:
                best, best_at = option, at
        put(best, best_at)
    drafts.sort(key=lambda d: (d.start, d.start_rank))
    return drafts


def _merge_runs(pctx: PlanContext, drafts: list[Draft], mode: str) -> list[Draft]:
    """Merge back-to-back tasks of the same group into one packed task where that is not slower
    (scheduling fine-grained, then packing what landed together, saves the per-task cost without
    losing balance). ``drafts`` must be in start order; returns them in the same order."""
    last: list[Optional[int]] = [None] * pctx.world  # index into ``out`` of each rank's last task
    out: list[Draft] = []
    padded: list[Optional[int]] = []  # padded tokens of each task of ``out``, once asked for
    for d in drafts:
        a, b = d.start_rank, d.start_rank + d.degree
        k = last[a]
        prev = out[k] if k is not None else None
        if prev is not None and prev.start_rank == a and prev.degree == d.degree and \
                all(last[r] == k for r in range(a, b)):
            if padded[k] is None:
                padded[k] = pctx.padded_tokens(prev.seqs, d.degree)
            tokens = padded[k] + pctx.padded_tokens(d.seqs, d.degree)
            fits_cap = tokens <= (pctx.pack_tokens or tokens)
            c = pctx.recompute_for(tokens, d.degree, mode) if fits_cap else None
            if c is not None:
                merged = pctx.draft(a, d.degree, prev.seqs + d.seqs, c, sums=(
                    prev.tokens + d.tokens, prev.pairs + d.pairs))
                if merged.duration <= prev.duration + d.duration:
                    merged.start = prev.start
                    out[k], padded[k] = merged, tokens
                    continue
        out.append(d)
        padded.append(None)
        for r in range(a, b):
            last[r] = len(out) - 1
    return out


def free_candidates(pctx: PlanContext, infos: list[SeqChoice], mode: str, bound: float,
                    longest: float) -> list[Candidate]:
    """The plan of every free pass this input gets (`SEARCH_PASSES`), from the sequences'
    degree choices ``infos``; ``bound``: the lower bound of the makespan, ``longest``: the
    longest sequence at its fastest degree."""
    candidates, seqs = [], {}  # seqs: the sequences per degree floor (`_sequences`)
    passes = [p._replace(floor=floor_of(pctx, p.floor)) for p in SEARCH_PASSES]
    for p in passes_for(pctx, passes):
        target = max(bound * p.target, longest)
        if p.floor not in seqs:
            seqs[p.floor] = _sequences(pctx, infos if p.floor == 1 else
                                       [raised(pctx, info, mode, p.floor) for info in infos])
        # tasks of at least OVERHEAD_TASKS x the fixed per-task cost keep that cost small
        limit = max(p.grain * target, OVERHEAD_TASKS * pctx.cm.time_model.task_overhead)
        tasks = _pack(pctx, seqs[p.floor], mode, limit)
        drafts = _merge_runs(pctx, _build(pctx, tasks, mode, target), mode)
        makespan = retime(drafts, pctx.world, barriers=False)
        candidates.append(Candidate(makespan, f"dcp(floor={p.floor},M={p.target},g={p.grain})",
                                    drafts))
    return candidates
