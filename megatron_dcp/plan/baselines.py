"""Baseline planners in the same framework: bucket, packed, static and greedy-cp.

Bucket, packed and static share one choice: the fixed sequence-parallel degree ``D`` of the run, a
power of two at which the longest sequence fits memory with the baseline's recompute mode
(greedy-cp instead gives each sequence its own power-of-two CP size, `plan_greedy_cp`). By default
for text (``tuned``) every such degree is tried and the fastest kept, as a practitioner tunes the
SP degree once for a data set: a strong baseline. ``baseline_degree="min"`` takes the smallest one
(the paper's literal "what the longest sequence needs", the default for videos); an integer fixes
the degree (a group size at which the longest sequence fits) for every batch of a run. The DCP
world is tiled by the vocabulary's groups of ``D`` ranks (ranks no group covers stay idle).
Recompute: ``bucket`` recomputes every layer (the paper's baseline); the others recompute one
number of layers for the whole run, the fewest that fit their largest micro-batch (what a
practitioner tunes once); ``recompute`` none/full overrides both.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from megatron_dcp.plan.cost import Layout
from megatron_dcp.plan.drafts import Draft, PlanContext, retime
from megatron_dcp.plan.plan import Plan, PlanError, Task


def candidate_degrees(pctx: PlanContext, mode: str) -> list[int]:
    """Power-of-two group sizes at which the longest sequence fits (smallest first); the smallest
    other size if no power of two fits."""
    longest = max(pctx.lengths[i] for i in pctx.active)
    sizes = pctx.vocab.sizes
    pow2 = [s for s in sizes if s & (s - 1) == 0]
    for group in (pow2, sizes):
        fit = [s for s in group if pctx.recompute_for(pctx.padded(longest, s), s, mode) is not None]
        if fit:
            return fit if group is pow2 else fit[:1]
    raise PlanError(f"the longest sequence ({longest} tokens) fits no group size")


def fixed_degree(pctx: PlanContext, degree: int, mode: str) -> int:
    """``degree`` if the longest sequence fits a group of that size, else `PlanError`."""
    longest = max(pctx.active, key=lambda i: (pctx.lengths[i], -i))
    n = pctx.lengths[longest]
    if pctx.recompute_for(pctx.padded(n, degree), degree, mode) is None:
        raise PlanError(f"baseline degree {degree}: sequence {longest} ({n} tokens) does not fit "
                        f"a group of {degree} ranks (recompute {mode}); choose a larger degree")
    return degree


Planner = Callable[[PlanContext], list[Draft]]


def tuned(planner: Callable[[PlanContext, int], list[Draft]]) -> Planner:
    """The baseline at its best fixed degree: a practitioner tunes the SP degree once for the data
    set, so the baseline gets every power-of-two degree at which the longest sequence fits and
    keeps the fastest (lockstep barriers included)."""

    def run(pctx: PlanContext, degree: Optional[int] = None) -> list[Draft]:
        if degree is not None:
            return planner(pctx, degree)
        best = None
        if isinstance(pctx.baseline_degree, int):
            degrees = [fixed_degree(pctx, pctx.baseline_degree, pctx.baseline_mode())]
        else:
            degrees = candidate_degrees(pctx, pctx.baseline_mode())
        if pctx.baseline_degree == "min":
            degrees = degrees[:1]
        for d in degrees:
            drafts = planner(pctx, d)
            makespan = retime(drafts, pctx.world, barriers=True)
            if best is None or makespan < best[0]:
                best = (makespan, drafts)
        return best[1]

    run.__name__ = planner.__name__
    run.__doc__ = planner.__doc__
    return run


def _groups(pctx: PlanContext, degree: int) -> list[int]:
    return list(pctx.vocab.first_ranks(degree))


def _run_recompute_layers(pctx: PlanContext, degree: int, max_tokens: int) -> int:
    """Recomputed layers for the whole run: the fewest that fit the largest micro-batch."""
    c = pctx.recompute_for(max_tokens, degree, pctx.recompute_mode)
    if c is None:
        c = pctx.cm.model.num_layers
    return c


@tuned
def plan_bucket(pctx: PlanContext, degree: int) -> list[Draft]:
    """Bucket parallel: one degree, every layer recomputed, micro-batches of one bucket handed
    to the groups in lockstep rounds, the buckets of the largest sequences first.

    Text: length buckets (powers of two), per-bucket batch size chosen so each micro-batch takes
    about as long as one longest sequence; a round holds micro-batches of one bucket. Videos
    (``pctx.frame_tokens``, VideoSys-style): shape buckets (frame size x power-of-two duration),
    per-bucket batch size the most videos of the bucket's largest shape that fill memory, cut to
    spread the bucket over every group while it has a video per group; as in Open-Sora's bucket
    sampler, every group draws a micro-batch of any bucket at each iteration, so the rounds take
    the micro-batches of all buckets, longest first (the order that wastes the least at the
    rounds' barriers)."""
    mode = pctx.baseline_mode()
    recompute_layers = pctx.cm.model.num_layers if mode == "full" else 0
    starts = _groups(pctx, degree)
    if pctx.frame_tokens is not None:
        micro = [mb for bucket in _video_micro_batches(pctx, degree, recompute_layers, len(starts))
                 for mb in bucket]
        times = [pctx.draft(starts[0], degree, mb, recompute_layers).duration for mb in micro]
        order = sorted(range(len(micro)), key=lambda k: (-times[k], micro[k][0]))
        buckets = [[micro[k] for k in order]]
    else:
        buckets = _text_micro_batches(pctx, degree, recompute_layers)
    drafts: list[Draft] = []
    clock = 0.0
    for micro in buckets:
        for r in range(0, len(micro), len(starts)):
            round_end = clock
            for start, mb in zip(starts, micro[r:r + len(starts)]):
                d = pctx.draft(start, degree, mb, recompute_layers, release=clock)
                d.start = clock
                drafts.append(d)
                round_end = max(round_end, clock + d.duration)
            clock = round_end
    return drafts


def _text_micro_batches(pctx: PlanContext, degree: int, recompute_layers: int
                        ) -> list[list[list[int]]]:
    """Micro-batches of each power-of-two length bucket, the longest bucket first: each takes
    about as long as one longest sequence and fits memory."""
    cm = pctx.cm
    buckets: dict[int, list[int]] = {}
    for i in pctx.active:
        buckets.setdefault(max(0, math.ceil(math.log2(pctx.lengths[i]))), []).append(i)
    longest = max(pctx.lengths[i] for i in pctx.active)
    t_ref = cm.time_model.best_time(longest, cm.attn_pairs(longest), degree, recompute_layers)[0]
    cap = cm.memory_model.max_tokens(degree, recompute_layers)
    result = []
    for k in sorted(buckets, reverse=True):
        seqs = sorted(buckets[k], key=lambda i: (-pctx.lengths[i], i))
        upper = min(2 ** k, longest)
        t_one = cm.time_model.best_time(upper, cm.attn_pairs(upper), degree, recompute_layers)[0]
        batch = max(1, min(int(t_ref // t_one), cap // max(1, pctx.padded(upper, degree))))
        result.append([seqs[j:j + batch] for j in range(0, len(seqs), batch)])
    return result


def video_bucket(length: int, frame_tokens: int) -> tuple[int, int]:
    """Shape bucket of a video of ``length`` tokens in frames of ``frame_tokens``: (frame size,
    duration bucket ``ceil(log2(frames))``; 0 holds the images)."""
    frames = max(1, length // frame_tokens)
    return frame_tokens, max(0, math.ceil(math.log2(frames)))


def _video_micro_batches(pctx: PlanContext, degree: int, recompute_layers: int,
                         groups: int) -> list[list[list[int]]]:
    """Micro-batches of each shape bucket (`video_bucket`), the bucket of the largest videos
    first. Batch size: as many videos of the bucket's largest as fit memory at
    ``recompute_layers`` (VideoSys tunes one per bucket so a micro-batch fills memory), lowered
    to spread the bucket's videos evenly over the ``groups`` SP groups when it holds fewer than
    that many full batches."""
    cap = pctx.cm.memory_model.max_tokens(degree, recompute_layers)
    buckets: dict[tuple[int, int], list[int]] = {}
    for i in pctx.active:
        buckets.setdefault(video_bucket(pctx.lengths[i], pctx.frame_tokens[i]), []).append(i)
    result = []
    order = sorted(buckets, key=lambda k: (-max(pctx.lengths[i] for i in buckets[k]), k))
    for key in order:
        seqs = sorted(buckets[key], key=lambda i: (-pctx.lengths[i], i))
        fill = max(1, cap // max(1, pctx.padded(pctx.lengths[seqs[0]], degree)))
        count = max(-(-len(seqs) // fill), min(len(seqs), groups))
        batch = -(-len(seqs) // count)
        result.append([seqs[j:j + batch] for j in range(0, len(seqs), batch)])
    return result


def _best_fit(pctx: PlanContext, order: list[int], budget: int, degree: int) -> list[list[int]]:
    """Best-fit decreasing of sequences into bins of ``budget`` padded tokens."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (remaining, bin index)
    for i in order:
        need = pctx.padded(pctx.lengths[i], degree)
        k = bisect.bisect_left(room, (need, -1))
        if k < len(room):
            remaining, b = room.pop(k)
            bins[b].append(i)
            bisect.insort(room, (remaining - need, b))
        else:
            bins.append([i])
            bisect.insort(room, (max(0, budget - need), len(bins) - 1))
    return bins


def _equal_count(pctx: PlanContext, bins: list[list[int]],
                 starts: list[int]) -> list[list[list[int]]]:
    """Bins to groups: the same number per group (up to one), balancing tokens greedily."""
    per_group = -(-len(bins) // len(starts))
    heap = [(0, g) for g in range(len(starts))]
    counts = [0] * len(starts)
    out: list[list[list[int]]] = [[] for _ in starts]
    for b in sorted(bins, key=lambda b: -sum(pctx.lengths[i] for i in b)):
        skipped = []
        while True:
            load, g = heapq.heappop(heap)
            if counts[g] < per_group:
                break
            skipped.append((load, g))
        out[g].append(b)
        counts[g] += 1
        heapq.heappush(heap, (load + sum(pctx.lengths[i] for i in b), g))
        for item in skipped:
            heapq.heappush(heap, item)
    return out


def _sequential(pctx: PlanContext, per_group: list[list[list[int]]], starts: list[int], degree: int,
                recompute_layers: int, layout: Optional[Layout] = None) -> list[Draft]:
    drafts = []
    for start, group_bins in zip(starts, per_group):
        for b in group_bins:
            drafts.append(pctx.draft(start, degree, b, recompute_layers, layout=layout))
    retime(drafts, pctx.world)
    return drafts


@tuned
def plan_packed(pctx: PlanContext, degree: int) -> list[Draft]:
    """One degree, sequences packed (best-fit decreasing) into micro-batches of a fixed token budget
    (``pack_tokens``, default: the longest sequence), the same number of micro-batches per group."""
    longest = max(pctx.padded(pctx.lengths[i], degree) for i in pctx.active)
    budget = max(pctx.pack_tokens or longest, longest)
    full = pctx.cm.memory_model.max_tokens(degree, pctx.cm.model.num_layers)
    budget = min(budget, max(longest, full))
    order = sorted(pctx.active, key=lambda i: (-pctx.lengths[i], i))
    bins = _best_fit(pctx, order, budget, degree)
    starts = _groups(pctx, degree)
    biggest = max(sum(pctx.padded(pctx.lengths[i], degree) for i in b) for b in bins)
    recompute_layers = _run_recompute_layers(pctx, degree, biggest)
    return _sequential(pctx, _equal_count(pctx, bins, starts), starts, degree, recompute_layers)


@tuned
def plan_static(pctx: PlanContext, degree: int) -> list[Draft]:
    """Megatron-style static context parallelism: ring attention at one CP size (unless
    ``attention_layout`` forbids ring there), THD micro-batches packed in data order up to the
    longest sequence, handed out round-robin to the DP groups."""
    budget = max(pctx.padded(pctx.lengths[i], degree) for i in pctx.active)
    bins: list[list[int]] = []
    used = budget
    for i in pctx.active:
        need = pctx.padded(pctx.lengths[i], degree)
        if used + need > budget:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += need
    starts = _groups(pctx, degree)
    per_group: list[list[list[int]]] = [[] for _ in starts]
    for j, b in enumerate(bins):
        per_group[j % len(starts)].append(b)
    recompute_layers = _run_recompute_layers(pctx, degree, budget)
    # ring unless the configured attention_layout rules it out (then its best allowed layout)
    ring_allowed = any(lay.ulysses == 1 for lay in pctx.cm.layouts(degree))
    ring_only = Layout(1, degree, True, degree <= pctx.cm.ranks_per_node) if ring_allowed else None
    return _sequential(pctx, per_group, starts, degree, recompute_layers, layout=ring_only)


def plan_greedy_cp(pctx: PlanContext) -> list[Draft]:
    """The shape of Megatron-LM's dynamic (hybrid) context parallel: per sequence a power-of-two CP
    size from a tokens-per-rank cap, workload estimate L^2/cp, greedy filling of lockstep rounds in
    which the ranks are partitioned into CP groups. The cap (Megatron's max tokens per rank) is
    tuned: the memory limit at the run's recomputed layers and halvings of it, fastest kept."""
    cm = pctx.cm
    longest = max(pctx.lengths[i] for i in pctx.active)
    recompute_layers = _run_recompute_layers(pctx, 1, pctx.padded(longest, 1))
    mem_cap = max(1, cm.memory_model.max_tokens(1, recompute_layers))
    floor = max(1, sum(pctx.lengths[i] for i in pctx.active) // (4 * pctx.world))
    best = None
    cap = mem_cap
    while True:
        drafts = _greedy_cp(pctx, cap, recompute_layers)
        makespan = retime(drafts, pctx.world, barriers=True)
        if best is None or makespan < best[0]:
            best = (makespan, drafts)
        cap //= 2
        if cap < floor or cap < 1 or pctx.baseline_degree != "tuned":
            return best[1]


def _greedy_cp(pctx: PlanContext, cap: int, recompute_layers: int) -> list[Draft]:
    """One greedy-cp plan for a tokens-per-rank ``cap`` and ``recompute_layers``: sequences sorted
    by estimated work (L^2 / CP size, largest first) fill lockstep rounds one after the other;
    a round ends when its longest task does."""
    size_of = _greedy_cp_sizes(pctx, cap)
    work = {i: pctx.lengths[i] ** 2 / size_of[i] for i in pctx.active}
    remaining = sorted(pctx.active, key=lambda i: (-work[i], i))
    drafts: list[Draft] = []
    clock = 0.0
    while remaining:
        open_blocks, remaining = _greedy_cp_round(pctx, remaining, size_of, work, cap)
        clock = _greedy_cp_drafts(pctx, open_blocks, recompute_layers, clock, drafts)
    return drafts


def _greedy_cp_sizes(pctx: PlanContext, cap: int) -> dict[int, int]:
    """CP size of every active sequence: the smallest power of two of the vocabulary that keeps
    it within ``cap`` tokens per rank and fits memory, else the smallest group size that fits."""
    vocab = pctx.vocab
    pow2 = [s for s in vocab.sizes if s & (s - 1) == 0]
    size_of = {}
    for i in pctx.active:
        want = 1 << max(0, math.ceil(math.log2(max(1, -(-pctx.lengths[i] // cap)))))
        n = pctx.lengths[i]
        fitting = [s for s in pow2
                   if s >= want and pctx.recompute_for(pctx.padded(n, s), s, "auto") is not None]
        if not fitting:
            fitting = [s for s in vocab.sizes
                       if pctx.recompute_for(pctx.padded(n, s), s, "auto") is not None]
        size_of[i] = fitting[0]
    return size_of


@dataclass(order=True, slots=True)
class _Block:
    """An open block of a greedy-cp round, ordered by its work and then its first rank."""

    load: float
    start: int
    seqs: list[int] = field(compare=False)
    tokens: int = field(compare=False)
    """Padded tokens of ``seqs``."""


def _greedy_cp_round(pctx: PlanContext, remaining: list[int], size_of: dict[int, int],
                     work: dict[int, float], cap: int) -> tuple[dict[int, list[_Block]], list[int]]:
    """Fill one round: each sequence joins the least-loaded open block of its CP size while the
    block stays within the round's work limit (the first sequence's work) and ``cap`` tokens per
    rank, else opens a block on the next free aligned group of that size. Returns the blocks by
    size (heaps of `_Block`) and the sequences left over."""
    busy = [False] * pctx.world
    pointer: dict[int, int] = {}
    open_blocks: dict[int, list[_Block]] = {}  # size -> heap of blocks
    limit = work[remaining[0]]
    left = []
    for i in remaining:
        size = size_of[i]
        need = pctx.padded(pctx.lengths[i], size)
        heap = open_blocks.setdefault(size, [])
        best = heap[0] if heap else None
        if best is not None and not (best.load + work[i] <= limit * 1.0000001
                                     and best.tokens + need <= cap * size):
            best = None
        if best is None:
            starts = pctx.vocab.first_ranks(size)
            p = pointer.get(size, 0)
            while p < len(starts) and any(busy[starts[p]:starts[p] + size]):
                p += 1
            pointer[size] = p
            if p < len(starts):
                for r in range(starts[p], starts[p] + size):
                    busy[r] = True
                fresh = _Block(work[i], starts[p], [i], need)
                heapq.heappush(heap, fresh)
                continue
        if best is None:
            left.append(i)
            continue
        best.load += work[i]
        best.seqs.append(i)
        best.tokens += need
        heapq.heapreplace(heap, best)
    return open_blocks, left


def _greedy_cp_drafts(pctx: PlanContext, open_blocks: dict[int, list[_Block]],
                      recompute_layers: int, clock: float, drafts: list[Draft]) -> float:
    """Append one draft per block of a round starting at ``clock`` (the run's ``recompute_layers``
    where it fits, else the fewest layers that fit, else every layer); returns the round's end."""
    cm = pctx.cm
    round_end = clock
    for size, blocks in sorted(open_blocks.items()):
        for block in blocks:
            tokens = block.tokens
            c = recompute_layers if pctx.recompute_for(tokens, size, "auto") is not None else None
            if c is None or cm.memory_model.memory_of(tokens, size, c) > cm.memory_model.budget:
                c = pctx.recompute_for(tokens, size, "auto") or cm.model.num_layers
            d = pctx.draft(block.start, size, block.seqs, c, release=clock)
            d.start = clock
            drafts.append(d)
            round_end = max(round_end, clock + d.duration)
    return round_end


def data_parallel_plan(lengths: Sequence[int], world_size: int) -> Plan:
    """Plain data parallel as a plan: sequence ``i`` alone on rank ``i % world_size``, as the
    ``i // world_size``-th micro-step of that rank (degree 1, no packing, no recompute)."""
    tasks = [Task(id=i, ranks=(i % world_size,), seqs=(i,), start=float(i // world_size))
             for i in range(len(lengths))]
    return Plan(tasks=tuple(tasks), lengths=tuple(lengths), world_size=world_size,
                policy="data-parallel")
