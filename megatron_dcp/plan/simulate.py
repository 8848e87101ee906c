"""`simulate`: run a plan through the cost model and report what a step would cost.

Semantics: every rank runs its tasks in the plan's global ``(start, id)`` order; a task starts when
all its ranks are free and not before its planned ``start`` (a lockstep baseline's round barrier);
its duration comes from the cost model for the ranks it is placed on (not from the plan). A
lockstep plan runs slot after slot: a slot starts when the previous one has ended and lasts the
longer of its longest task and `TimeModel.slot_time` (the planner's rule, `retime_slots`). The
step ends with one gradient reduction and optimizer step (``sync_s``, the same for every policy).
With a pipeline (``pipeline``, ``P > 1``; ``cm`` the stage's cost model) the slots are its
micro-batches and run through its schedule event by event (`megatron_dcp.plan.pipeline`): the
makespan includes the bubble, the lower bound the pipeline's fill and drain, and the in-flight
memory is checked.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Iterator, NamedTuple, Optional, Sequence

from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.hardware import layout_kind
from megatron_dcp.plan.pipeline import (Pipeline, PipelineResult, padding_cost,
                                        simulate_pipeline, slot_costs)
from megatron_dcp.plan.pipeline_order import pipeline_lower_bound
from megatron_dcp.plan.plan import Plan
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
    moldable_lower_bound_s: float = 0.0
    """Tighter bound (`lower_bound` with ``moldable=True``) + sync."""
    moldable_efficiency: float = 0.0
    busy_s: list[float] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)
    num_tasks: int = 0
    starts: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    bubble_share: float = 0.0
    """Pipeline: idle share of a stage's makespan (0 without a pipeline)."""
    memory_fits: bool = True
    """Pipeline: every rank's in-flight peak on every stage is within the budget."""
    peak_memory_gib: float = 0.0
    """Pipeline: the highest in-flight peak of any rank on any stage (static memory included)."""
    micro_batches: int = 0
    """Pipeline: micro-batches (lockstep slots) per step."""

    def summary(self) -> dict:
        """Scalars only (no per-rank lists)."""
        d = asdict(self)
        for key in ("busy_s", "idle_s", "starts", "durations"):
            d.pop(key)
        return d


def lower_bound(lengths: Sequence[int], cm: CostModel, *, world_size: Optional[int] = None,
                max_degree: Optional[int] = None, recompute_mode: str = "auto",
                moldable: bool = False, frame_tokens: Optional[Sequence[int]] = None) -> float:
    """The larger of `_bound` with ring traffic fully hidden and half hidden (both valid).
    ``frame_tokens``: tokens per frame of each of ``lengths`` (videos of mixed resolution;
    ``None``: the model's)."""
    pairs = [cm.pairs_of(n, s) for n, s in
             zip(lengths, frame_tokens if frame_tokens is not None else [None] * len(lengths))]
    return max(_bound(lengths, pairs, cm, world_size, max_degree, recompute_mode, moldable, hidden)
               for hidden in (1.0, 0.5))


def _bound(lengths: Sequence[int], pairs_of: Sequence[float], cm: CostModel,
           world_size: Optional[int], max_degree: Optional[int],
           recompute_mode: str, moldable: bool, hidden: float) -> float:
    """Seconds (without the step's ``sync_time``) that no plan over the vocabulary's group sizes
    can beat: ``max(longest sequence at its fastest degree, total minimal work / ranks)``, work =
    ranks x `TimeModel.marginal_time` at the least-work degree (per-task costs can be shared by
    packing, so they are left out).

    ``pairs_of``: attention pairs of each sequence (`CostModel.pairs_of`).
    ``moldable=True`` tightens it: a step of length T must run every sequence at a degree where it
    takes at most T, so its work is the least among those degrees; the bound is the smallest T with
    total work / ranks <= T (a sequence that must be spread for time costs extra work).
    """
    world = world_size or cm.world_size
    options = _DegreeOptions(cm, Vocabulary(world, cm.ranks_per_node, max_degree), recompute_mode,
                             hidden)
    work, seqs = _least_work(lengths, pairs_of, options)
    per_rank = work / world
    bound = max(per_rank, _longest_fastest(seqs, per_rank, options))
    if not moldable:
        return bound
    return _moldable_bound(bound, work, seqs, options, world)


class _DegreeOption(NamedTuple):
    """A degree where a sequence fits (`_DegreeOptions`): its best time and its least work."""

    degree: int
    time: float
    work: float


class _SeqWork(NamedTuple):
    """A sequence that fits somewhere (`_least_work`): its least work and the time there."""

    length: int
    pairs: float
    work: float
    time: float


class _DegreeOptions:
    """The `_DegreeOption`s of one sequence for `_bound`: every degree of the vocabulary where
    it fits memory under the recompute mode, each with the time of its best layout and the work
    (ranks x `TimeModel.marginal_time`, ring traffic ``hidden``) of its least-work layout."""

    def __init__(self, cm: CostModel, vocab: Vocabulary, recompute_mode: str, hidden: float
                 ) -> None:
        self.cm, self.vocab, self.recompute_mode, self.hidden = cm, vocab, recompute_mode, hidden
        self.kinds = {layout_kind(lay.ulysses, lay.ring) for d in vocab.sizes
                      for lay in cm.layouts(d)}

    def recompute_layers(self, tokens: int, d: int) -> Optional[int]:
        """Recomputed layers of ``tokens`` local tokens on ``d`` ranks under the policy (``none``:
        0, ``full``: every layer, else the fewest that fit); ``None`` where they do not fit."""
        mem = self.cm.memory_model
        n_layers = self.cm.model.num_layers
        if self.recompute_mode == "none":
            return 0 if mem.memory_of(tokens, d, 0) <= mem.budget else None
        if self.recompute_mode == "full":
            return n_layers if mem.memory_of(tokens, d, n_layers) <= mem.budget else None
        return mem.min_recompute_layers(tokens, d)

    def __call__(self, n: int, pairs: float, least_work_only: bool) -> Iterator[_DegreeOption]:
        """A `_DegreeOption` per fitting degree, exact best layout. ``least_work_only``: stop
        once no wider degree can need less work. Past the first degree without recompute, work
        only grows with the degree within one layout kind (more communication, slower links), so
        the search ends when every kind has been seen without recompute."""
        cm, hidden = self.cm, self.hidden
        seen: set[str] = set()
        for d in self.vocab.sizes:
            c = self.recompute_layers(cm.padded(n, d), d)
            if c is None:
                continue
            layouts = cm.layouts(d)
            yield _DegreeOption(
                d, min(cm.time_model.time_of(n, pairs, lay, c) for lay in layouts),
                d * min(cm.time_model.marginal_time(n, pairs, lay, c, hidden) for lay in layouts))
            if least_work_only and c == 0:
                seen.update(layout_kind(lay.ulysses, lay.ring) for lay in layouts)
                if seen >= self.kinds:
                    return


def _least_work(lengths: Sequence[int], pairs_of: Sequence[float], options: _DegreeOptions
                ) -> tuple[float, list[_SeqWork]]:
    """Total least work of the sequences that fit somewhere, and each such sequence's
    `_SeqWork`."""
    work = 0.0
    seqs: list[_SeqWork] = []
    for n, pairs in zip(lengths, pairs_of):
        best = None
        for option in options(n, pairs, True):
            if best is None or option.work < best.work:
                best = option
        if best is None:
            continue
        work += best.work
        seqs.append(_SeqWork(n, pairs, best.work, best.time))
    return work, seqs


def _longest_fastest(seqs: Sequence[_SeqWork], per_rank: float, options: _DegreeOptions
                     ) -> float:
    """The longest of the sequences' fastest times over all degrees, visiting them by their
    least-work time and stopping where none left can raise ``max(per_rank, longest)``."""
    longest = 0.0
    for x in sorted(seqs, key=lambda x: -x.time):
        if x.time <= max(per_rank, longest):
            break  # its fastest time is at most its time: cannot raise the bound
        longest = max(longest, min(o.time for o in options(x.length, x.pairs, False)))
    return longest


def _moldable_bound(bound: float, work: float, seqs: Sequence[_SeqWork],
                    options: _DegreeOptions, world: int) -> float:
    """The moldable tightening of ``bound`` (see `_bound`): sequences whose least-work time
    exceeds it trade work for time; bisection for the smallest feasible step length."""
    frontier, fixed = [], work
    for x in seqs:
        if x.time > bound:
            fixed -= x.work
            frontier.append(sorted((o.time, o.work) for o in options(x.length, x.pairs, False)))

    def feasible(limit: float) -> bool:
        total = fixed
        for opts in frontier:
            total += min((w_d for t_d, w_d in opts if t_d <= limit), default=math.inf)
        return total <= world * limit

    high = max([bound] + [t_d for opts in frontier for t_d, _ in opts])
    low = bound
    if not frontier or feasible(low):
        return low
    for _ in range(60):
        mid = 0.5 * (low + high)
        low, high = (low, mid) if feasible(mid) else (mid, high)
    return low


def _slot_starts(plan: Plan, cm: CostModel, parts: Sequence) -> list[float]:
    """Start of every slot of a lockstep plan, and its end as the last entry."""
    durations = cm.time_model.slot_durations(
        plan.slot_recompute_layers(), ((t.slot, p.total) for t, p in zip(plan.tasks, parts)))
    return list(itertools.accumulate(durations, initial=0.0))


class _Timeline(NamedTuple):
    """A plan replayed on its ranks: per rank the busy seconds, per task (plan order) its start
    and duration, the end of the last task (or slot), and the rank-seconds of all tasks, of
    their exposed communication and of their recompute."""

    busy: list[float]
    starts: list[float]
    durations: list[float]
    end: float
    total: float
    comm: float
    recompute: float


def _replay(plan: Plan, cm: CostModel) -> _Timeline:
    """Every task of ``plan`` at its cost-model time, in (start, id) order: a free plan's task
    starts when all its ranks are free (not before its planned start), a lockstep plan's at its
    slot's start."""
    avail = [0.0] * plan.world_size
    busy = [0.0] * plan.world_size
    starts, durations = [], []
    comm = recompute = total = 0.0
    end_max = 0.0
    parts_of = [cm.time_model.task_breakdown(t, plan.lengths, plan.frame_tokens)
                for t in plan.tasks]
    slot_start = _slot_starts(plan, cm, parts_of) if plan.lockstep else None
    for t, parts in zip(plan.tasks, parts_of):  # already in (start, id) order
        if slot_start is not None:
            start = slot_start[t.slot]
        else:
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
    if slot_start is not None:
        end_max = slot_start[-1]  # the end of the last slot
    return _Timeline(busy, starts, durations, end_max, total, comm, recompute)


def simulate(plan: Plan, cm: CostModel, *, bound: Optional[float] = None,
             moldable_bound: Optional[float] = None, max_degree: Optional[int] = None,
             recompute_mode: str = "auto", pipeline: Optional[Pipeline] = None) -> SimResult:
    """Simulate ``plan`` (see module doc); ``bound`` / ``moldable_bound``: precomputed
    `lower_bound` values without sync (computed from the plan's sequences when not given; with
    a pipeline, its fill and drain are added here). ``pipeline``: the stages the plan's slots
    run through (``cm``: one stage's cost model)."""
    world, frames = plan.world_size, plan.frame_tokens
    line = _replay(plan, cm)
    end_max = line.end
    seqs = [s for t in plan.tasks for s in t.seqs]
    ran = [plan.lengths[s] for s in seqs]
    ran_frames = [frames[s] for s in seqs] if frames is not None else None
    if bound is None:
        bound = lower_bound(ran, cm, world_size=world, max_degree=max_degree,
                            recompute_mode=recompute_mode, frame_tokens=ran_frames)
    if moldable_bound is None:
        moldable_bound = lower_bound(ran, cm, world_size=world, max_degree=max_degree,
                                     recompute_mode=recompute_mode, moldable=True,
                                     frame_tokens=ran_frames)
    piped = None
    if pipeline is not None and pipeline.stages > 1 and plan.tasks:
        costs = slot_costs(plan, cm)
        piped = simulate_pipeline(costs, pipeline, cm)
        end_max = piped.makespan_s
        padding = padding_cost(cm, world)
        bound = pipeline_lower_bound(bound, costs, pipeline, padding)
        moldable_bound = pipeline_lower_bound(moldable_bound, costs, pipeline, padding)
    return _result(plan, cm, line, end_max, sum(ran), cm.time_model.model_flops(ran, ran_frames),
                   bound, moldable_bound, piped)


def _result(plan: Plan, cm: CostModel, line: _Timeline, end_max: float, tokens: int,
            flops: float, bound: float, moldable_bound: float,
            piped: Optional[PipelineResult]) -> SimResult:
    """The `SimResult` of a replayed plan whose tasks end at ``end_max`` (the pipeline's
    makespan where ``piped``), with the step's sync added to the time and the bounds."""
    world, busy, total = plan.world_size, line.busy, line.total
    sync = cm.time_model.sync_time()
    step = end_max + sync
    mean_busy = sum(busy) / world
    return SimResult(
        step_time_s=step, makespan_s=end_max, sync_s=sync, tokens=tokens,
        tokens_per_s=tokens / step if step > 0 else 0.0,
        lower_bound_s=bound + sync, efficiency=(bound + sync) / step if step > 0 else 1.0,
        imbalance=(max(busy) / mean_busy - 1.0) if mean_busy > 0 else 0.0,
        comm_share=line.comm / total if total else 0.0,
        recompute_share=line.recompute / total if total else 0.0,
        mfu=flops / (step * world * cm.hw.peak_flops) if step > 0 else 0.0,
        moldable_lower_bound_s=moldable_bound + sync,
        moldable_efficiency=(moldable_bound + sync) / step if step > 0 else 1.0,
        busy_s=busy, idle_s=[end_max - b for b in busy], num_tasks=len(plan.tasks),
        starts=line.starts, durations=line.durations,
        bubble_share=piped.bubble_share if piped else 0.0,
        memory_fits=piped.fits if piped else True,
        peak_memory_gib=max(piped.peak_bytes) / 2**30 if piped else 0.0,
        micro_batches=piped.micro_batches if piped else 0,
    )
