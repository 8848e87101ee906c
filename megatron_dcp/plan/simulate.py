"""`simulate`: run a plan through the cost model and report what a step would cost.

Semantics: every rank runs its tasks in the plan's global ``(start, id)`` order; a task starts when
all its ranks are free and not before its planned ``start`` (a lockstep baseline's round barrier);
its duration comes from the cost model for the ranks it is placed on (not from the plan). The step
ends with one gradient reduction and optimizer step (``sync_s``, the same for every policy).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.plan import Plan
from megatron_dcp.plan.schedule import padded
from megatron_dcp.plan.vocabulary import Vocabulary


@dataclass
class SimResult:
    """What one plan costs under the cost model."""

    step_time_s: float
    makespan_s: float
    sync_s: float
    tokens: int
    tokens_per_s: float
    lower_bound_s: float
    efficiency: float
    imbalance: float
    """max busy / mean busy - 1 over ranks."""
    comm_share: float
    recompute_share: float
    mfu: float
    busy_s: list[float] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)
    num_tasks: int = 0
    starts: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        """Scalars only (no per-rank lists)."""
        d = asdict(self)
        for key in ("busy_s", "idle_s", "starts", "durations"):
            d.pop(key)
        return d


def lower_bound(lengths: Sequence[int], cm: CostModel, *, world_size: Optional[int] = None,
                max_degree: Optional[int] = None, ckpt_policy: str = "auto") -> float:
    """``max(longest sequence at its fastest degree, total minimal work / ranks)`` (seconds, without
    the step's ``sync_time``). Work excludes the per-task overhead that packing can share."""
    world = world_size or cm.world_size
    vocab = Vocabulary(world, cm.ranks_per_node, max_degree)
    n_layers = cm.model.num_layers

    def ckpt(tokens: int, d: int) -> Optional[int]:
        if ckpt_policy == "none":
            return 0 if cm.memory_of(tokens, d, 0) <= cm.budget else None
        if ckpt_policy == "full":
            return n_layers if cm.memory_of(tokens, d, n_layers) <= cm.budget else None
        return cm.min_ckpt(tokens, d)

    overhead = cm.task_overhead
    work = 0.0
    first: list[tuple[int, int, float, int, int]] = []
    for n in lengths:
        pairs = cm.attn_pairs(n)
        best = None
        for d in vocab.sizes:
            c = ckpt(padded(n, d), d)
            if c is None:
                continue
            w = d * max(cm.best_time(n, pairs, d, c)[0] - overhead, 0.0)
            if best is not None and w >= best[0]:
                break
            best = (w, d, c)
        if best is None:
            continue
        work += best[0]
        first.append((n, best[1], pairs, best[0], best[2]))
    per_rank = work / world
    longest = 0.0
    for n, d0, pairs, w, c0 in first:
        if w / d0 + overhead <= max(per_rank, longest):
            continue  # its fastest time is at most its time at d0: cannot raise the bound
        fastest = w / d0 + overhead
        for d in vocab.sizes:
            c = ckpt(padded(n, d), d)
            if c is not None:
                fastest = min(fastest, cm.best_time(n, pairs, d, c)[0])
        longest = max(longest, fastest)
    return max(per_rank, longest)


def simulate(plan: Plan, cm: CostModel, *, bound: Optional[float] = None, max_degree: Optional[int] = None,
             ckpt_policy: str = "auto") -> SimResult:
    """Simulate ``plan`` (see module doc); ``bound``: a precomputed `lower_bound`."""
    world = plan.world_size
    avail = [0.0] * world
    busy = [0.0] * world
    starts, durations = [], []
    comm = recompute = total = 0.0
    end_max = 0.0
    for t in plan.tasks:  # already in (start, id) order
        parts = cm.task_breakdown(t, plan.lengths)
        start = max(t.start, max(avail[r] for r in t.ranks))
        end = start + parts.total
        for r in t.ranks:
            avail[r] = end
            busy[r] += parts.total
        end_max = max(end_max, end)
        starts.append(start)
        durations.append(parts.total)
        d = len(t.ranks)
        comm += parts.comm * d
        recompute += parts.recompute * d
        total += parts.total * d
    seqs = [s for t in plan.tasks for s in t.seqs]
    tokens = sum(plan.lengths[s] for s in seqs)
    sync = cm.sync_time()
    step = end_max + sync
    if bound is None:
        bound = lower_bound([plan.lengths[s] for s in seqs], cm, world_size=world, max_degree=max_degree,
                            ckpt_policy=ckpt_policy)
    mean_busy = sum(busy) / world
    flops = cm.model_flops([plan.lengths[s] for s in seqs])
    return SimResult(
        step_time_s=step, makespan_s=end_max, sync_s=sync, tokens=tokens,
        tokens_per_s=tokens / step if step > 0 else 0.0,
        lower_bound_s=bound + sync, efficiency=(bound + sync) / step if step > 0 else 1.0,
        imbalance=(max(busy) / mean_busy - 1.0) if mean_busy > 0 else 0.0,
        comm_share=comm / total if total else 0.0, recompute_share=recompute / total if total else 0.0,
        mfu=flops / (step * world * cm.hw.peak_flops) if step > 0 else 0.0,
        busy_s=busy, idle_s=[end_max - b for b in busy], num_tasks=len(plan.tasks),
        starts=starts, durations=durations,
    )
