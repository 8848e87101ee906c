"""Pipeline parallelism in the planner: lockstep slots are the pipeline's micro-batches.

Every pipeline stage runs the same lockstep plan (docs/PLAN_FORMAT.md): slot ``k`` is micro-batch
``k`` on every pipeline, and a task's group is the same pipelines at every stage. A stage holds
``num_layers / P`` layers (`stage_model`); the cost model of that shape times one slot on one stage
(its longest task, as `megatron_dcp.plan.simulate` does without pipelines).

`simulate_pipeline` runs the slots through Megatron's schedule event by event: per stage, the
forward and backward of every micro-batch in Megatron's order (1F1B: ``P - s - 1`` warm-up
forwards on stage ``s``, then one forward one backward, then the cool-down backwards; interleaved
with ``V`` virtual stages: Megatron's schedule table in groups of ``P`` micro-batches and its
warm-up count; the count padded with empty micro-batches to one the interleaved schedule
accepts, `interleaved_micro_batches`, as the runtime pads it), each op starting when its stage
is free and its input has arrived (the previous virtual stage's forward, the next one's
backward, plus the P2P of the activations between devices). So the makespan contains the
bubble. Memory follows the same order: a micro-batch's kept activations
(`MemoryModel.kept_token_bytes`) are held from its forward to its backward, so 1F1B
stage ``s`` holds up to ``P - s`` micro-batches (stage 0 the most), and a plan fits when every
rank's peak on every stage is within the budget.

`order_slots` is the bubble-aware post-pass: the order of a plan's slots chosen on the simulated
makespan among a few orders that fit memory (short slots first and last where the pipeline fills
and drains, long ones side by side in the middle where the slots run between a micro-batch's
forward and backward on stage 0 can cover its trip through the later stages).
`pipeline_lower_bound`: what no order of the slots beats (the fill and drain, the longest
micro-batch through every stage, and the wait it imposes on stage 0). `shortest_candidate`: the
DCP contest's winner on the simulated makespan, skipping the candidates whose bound already
exceeds the best makespan found.

Model simplifications: a forward is ``1 / (3 + c/N)`` of a slot's stage time and the backward the
rest (the cost model's passes); every stage counts the embedding and the head (the stage shape
keeps them: conservative for time and memory); P2P sends each rank's local tokens x hidden in bf16
over the inter-node link, hidden behind nothing: every tensor-parallel rank sends the whole
activation, or with sequence parallelism (``model.sequence_parallel``) its 1/TP of the tokens
(the shard padded to a multiple of TP, as the runtime pads it).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.memory import BF16
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import Plan, PlanError, padded_length

ORDER_EVALUATIONS = 64
"""Most slot orders `order_slots` simulates (a few fixed orders, then swaps that improve)."""
TRIPS_TRIED = 4
"""Slots whose window `_stage0_idle_interleaved` bounds (the longest trips)."""
FIXED_ORDERS = 6
"""The fixed orders `best_order` tries first (``evaluations=FIXED_ORDERS``: those only)."""


def interleaved_micro_batches(count: int, stages: int, group: Optional[int] = None,
                              virtual: int = 2) -> int:
    """The fewest micro-batches, at least ``count``, that Megatron's interleaved schedule runs
    with ``stages`` pipeline stages, ``virtual`` model chunks per rank and ``group``
    (``microbatch_group_size_per_vp_stage``, default ``stages``) micro-batches per group: at
    least one group, a last group that is whole or holds at least ``stages``, and more chunk
    micro-batches than stage 0's warm-up (``2 (P - 1) + (V - 1) group``). With fewer, stage 0 runs
    every micro-batch in warm-up while the later stages enter 1F1B, and the stages' shape
    exchanges meet in different orders: on gloo the job hangs (DP 2 x PP 2 x V 2 with a plan of
    2 slots). A lockstep plan is padded with empty slots up to it."""
    group = group or stages
    warmup = 2 * (stages - 1) + (virtual - 1) * group
    m = max(count, group, warmup // virtual + 1)
    while 0 < m % group < stages:
        m += 1
    return m


@dataclass(frozen=True)
class Pipeline:
    """Pipeline stages ``P`` and virtual stages ``V`` per pipeline rank."""

    stages: int = 1
    virtual: int = 1

    @classmethod
    def of(cls, model: ModelShape) -> "Pipeline":
        """The pipeline of a model shape (`ModelShape.pipeline_parallel`, ``virtual_pipeline``)."""
        return cls(model.pipeline_parallel, model.virtual_pipeline)

    def micro_batches(self, count: int) -> int:
        """The micro-batches the schedule runs for ``count`` slots: ``count`` in 1F1B, the
        interleaved schedule's padded count (`interleaved_micro_batches`, groups of ``P``)."""
        if self.virtual == 1 or count == 0:
            return count
        return interleaved_micro_batches(count, self.stages, virtual=self.virtual)

    def warmup(self, stage: int, micro_batches: int) -> int:
        """Forwards (of model chunks) stage ``stage`` runs before its first backward: Megatron's
        count, at most every chunk of every micro-batch."""
        p, v = self.stages, self.virtual
        warm = p - stage - 1 if v == 1 else (p - stage - 1) * 2 + (v - 1) * p
        return min(warm, micro_batches * v)

    def held(self, stage: int, micro_batches: Optional[int] = None) -> float:
        """Micro-batches' activations stage ``stage`` holds at most (chunks / V): ``P - s`` in
        1F1B; interleaved its warm-up plus one chunk. ``micro_batches``: at most that many."""
        m = micro_batches if micro_batches is not None else 1 << 30
        return min(self.warmup(stage, m) + 1, m * self.virtual) / self.virtual


def stage_model(model: ModelShape) -> ModelShape:
    """The shape of one pipeline stage: ``num_layers / P`` layers (the embedding and the head
    kept, conservatively), without pipeline fields; the model itself when ``P == 1``."""
    if model.pipeline_parallel == 1 and model.virtual_pipeline == 1:
        return model
    return replace(model, num_layers=model.layers_per_stage, pipeline_parallel=1,
                   virtual_pipeline=1)


def micro_batch_cost_model(cm: CostModel, pipe: Pipeline, share: float = 1.0) -> CostModel:
    """``cm`` with the budget of one micro-batch: static memory and reserve plus ``share`` /
    `Pipeline.held` (stage 0) of what is left for activations, so that the micro-batches stage 0
    holds fit together in any order (``share`` 1.0)."""
    mem = cm.memory_model
    free = mem.budget - mem.static_memory - mem.reserve
    budget = mem.static_memory + mem.reserve + free * share / pipe.held(0)
    return CostModel(cm.model, cm.hw, world_size=cm.world_size, zero_stage=cm.zero_stage,
                     ranks_per_node=cm.ranks_per_node, memory_budget=budget,
                     attention_layout=cm.attention_layout, ulysses_scope=cm.ulysses_scope,
                     communicators_per_rank=mem.communicators_per_rank)


@dataclass
class SlotCost:
    """One micro-batch (lockstep slot) on one pipeline stage."""

    forward: float
    backward: float
    p2p: float
    """Seconds to send its activations (or their gradients) to the next stage."""
    kept: list[float]
    """Bytes per rank held from its forward to its backward."""
    running: list[float]
    """Bytes per rank needed on top while it runs (recompute buffer, logits)."""

    @property
    def time(self) -> float:
        """Forward and backward."""
        return self.forward + self.backward


def slot_costs(plan: Plan, cm: CostModel) -> list[SlotCost]:
    """The stage cost of every slot of a lockstep ``plan`` under the stage cost model ``cm``: its
    length as the simulator's (the longest task, at least `TimeModel.slot_time`), split into
    forward and backward; P2P and memory from each rank's local tokens (an idle rank runs an
    empty micro-step: nothing held)."""
    if not plan.lockstep:
        raise PlanError("a pipeline runs lockstep plans only (slots are its micro-batches)")
    depths = plan.slot_recompute_layers()
    n_slots, world = len(depths), plan.world_size
    length = [cm.time_model.slot_time(c) for c in depths]
    local = [[0] * world for _ in range(n_slots)]
    frames = plan.frame_tokens
    for t in plan.tasks:
        length[t.slot] = max(length[t.slot], cm.time_model.task_time(t, plan.lengths, frames))
        tokens = sum(padded_length(plan.lengths[s], t.ulysses, t.ring) for s in t.seqs)
        for r in t.ranks:
            local[t.slot][r] = math.ceil(tokens / len(t.ranks))
    n = cm.model.num_layers
    costs = []
    for k, c in enumerate(depths):
        forward = length[k] / (3.0 + c / n)
        kept, total = cm.memory_model.kept_token_bytes(c), cm.memory_model.token_bytes(c)
        costs.append(SlotCost(forward, length[k] - forward, p2p_time(max(local[k]), cm),
                              [x * kept for x in local[k]], [x * (total - kept) for x in local[k]]))
    return costs


def p2p_time(tokens: int, cm: CostModel) -> float:
    """Seconds to send the activations of ``tokens`` local tokens to the next stage: hidden x
    bf16 per token over the inter-node link; with sequence parallelism each tensor-parallel rank
    sends its 1/TP of them (the shard padded to a multiple of TP)."""
    m = cm.model
    if m.sequence_parallel and m.tensor_parallel > 1:
        tokens = math.ceil(tokens / m.tensor_parallel)
    return tokens * m.hidden_size * BF16 / cm.hw.inter_bandwidth + cm.hw.inter_latency


PADDING_TOKENS = 2
"""Tokens of the empty micro-batch the runtime pads an interleaved schedule with (per rank)."""


def padding_cost(cm: Optional[CostModel], world: int) -> SlotCost:
    """One empty micro-batch that pads the interleaved schedule (`Pipeline.micro_batches`):
    ``PADDING_TOKENS`` on every rank, no recompute, as long as the shortest slot
    (`TimeModel.slot_time`); nothing at all without a cost model."""
    if cm is None:
        return SlotCost(0.0, 0.0, 0.0, [0.0] * world, [0.0] * world)
    length = cm.time_model.slot_time(0)
    kept, total = cm.memory_model.kept_token_bytes(0), cm.memory_model.token_bytes(0)
    forward = length / 3.0
    return SlotCost(forward, length - forward, p2p_time(PADDING_TOKENS, cm),
                    [PADDING_TOKENS * kept] * world, [PADDING_TOKENS * (total - kept)] * world)


def device_ops(pipe: Pipeline, stage: int, micro_batches: int) -> list[tuple[bool, int, int]]:
    """Megatron's op order on pipeline rank ``stage``: ``(forward?, micro-batch, model chunk)``.
    Warm-up forwards (`Pipeline.warmup`), then one forward one backward, then the cool-down
    backwards; chunks in Megatron's schedule table (groups of ``P`` micro-batches, every chunk of
    a group before the next group; backward chunks in reverse)."""
    p, v, m = pipe.stages, pipe.virtual, micro_batches
    table = []
    for first in range(0, m, p):
        group = range(first, m if first + p >= m else first + p)
        table += [(k, chunk) for chunk in range(v) for k in group]
    backward = [(k, v - 1 - chunk) for k, chunk in table]
    total, warm = m * v, pipe.warmup(stage, m)
    ops = [(True, *table[i]) for i in range(warm)]
    for i in range(total - warm):
        ops += [(True, *table[warm + i]), (False, *backward[i])]
    ops += [(False, *backward[i]) for i in range(total - warm, total)]
    return ops


@dataclass
class PipelineResult:
    """One plan's slots through the pipeline schedule."""

    makespan_s: float
    busy_s: float
    """Compute seconds of one stage (every stage runs the same slots)."""
    bubble_share: float
    """Idle share of a stage's time: 1 - busy / makespan."""
    peak_bytes: list[float]
    """Per stage, the highest memory of any rank (static memory and reserve included)."""
    held: list[float]
    """Per stage, the most micro-batches (chunks / V) in flight at once."""
    fits: bool
    """Every rank's peak on every stage is within the budget."""
    micro_batches: int = 0
    """Micro-batches run: the slots and any padding (`Pipeline.micro_batches`)."""
    ops: list[list[tuple[bool, int, int, float, float]]] = field(default_factory=list)
    """Per stage: (forward?, micro-batch, chunk, start, end) in run order."""


def simulate_pipeline(costs: Sequence[SlotCost], pipe: Pipeline, cm: Optional[CostModel] = None,
                      order: Optional[Sequence[int]] = None,
                      padding: Optional[SlotCost] = None, memory: bool = True) -> PipelineResult:
    """Run the slots ``costs`` (micro-batch ``k`` is ``costs[order[k]]``; default in order)
    through the schedule (module doc); memory against ``cm``'s budget when given. An
    interleaved schedule runs ``padding`` (default `padding_cost` of ``cm``) after the slots up
    to the count it accepts (`Pipeline.micro_batches`), as the runtime does. ``memory=False``:
    the makespan only (no ``peak_bytes``, ``held`` or ``runs``; ``fits`` left True)."""
    seq = _padded([costs[i] for i in (order if order is not None else range(len(costs)))],
                  pipe, cm, padding)
    p, m = pipe.stages, len(seq)
    if m == 0:
        return PipelineResult(0.0, 0.0, 0.0, [0.0] * p, [0.0] * p, True, 0, [[] for _ in range(p)])
    ops = [_device_ops(pipe, s, m) for s in range(p)]
    free, runs = _run_ops(ops, seq, pipe, memory)
    makespan = max(free)
    busy = sum(c.time for c in seq)
    bubble = 1.0 - busy / makespan if makespan > 0 else 0.0
    if not memory:
        return PipelineResult(makespan, busy, bubble, [], [], True, m, [])
    peaks, held = _memory(ops, seq, pipe, cm)
    fits = cm is None or max(peaks) <= cm.memory_model.budget * (1 + 1e-12)
    return PipelineResult(makespan, busy, bubble, peaks, held, fits, m, runs)


def _run_ops(ops: list[tuple[tuple[bool, int, int], ...]], seq: Sequence[SlotCost],
             pipe: Pipeline, record: bool
             ) -> tuple[list[float], list[list[tuple[bool, int, int, float, float]]]]:
    """`simulate_pipeline`'s event loop: each stage's ops in order, each as soon as its stage is
    free and its input has arrived; every stage's end and (``record``) its ops' runs."""
    p, v, m = pipe.stages, pipe.virtual, len(seq)
    last = p * v - 1
    hops = [c.p2p if p > 1 else 0.0 for c in seq]
    forwards = [c.forward / v for c in seq]
    backwards = [c.backward / v for c in seq]
    # end of micro-batch k's forward / backward on virtual stage g: [g][k], None until run
    fwd_end: list[list[Optional[float]]] = [[None] * m for _ in range(last + 1)]
    bwd_end: list[list[Optional[float]]] = [[None] * m for _ in range(last + 1)]
    ptr, free = [0] * p, [0.0] * p
    runs: list[list[tuple[bool, int, int, float, float]]] = [[] for _ in range(p)]
    left = sum(len(o) for o in ops)
    while left:
        progressed = False
        for s in range(p):
            device, at, clock = ops[s], ptr[s], free[s]
            while at < len(device):
                forward, k, chunk = device[at]
                g = chunk * p + s  # virtual stage
                if forward:
                    if g == 0:
                        ready = 0.0
                    else:
                        ready = fwd_end[g - 1][k]
                        if ready is None:
                            break
                        ready += hops[k]
                    duration = forwards[k]
                else:
                    if g == last:
                        ready = fwd_end[g][k]
                        if ready is None:
                            break
                    else:
                        ready = bwd_end[g + 1][k]
                        if ready is None:
                            break
                        ready += hops[k]
                    duration = backwards[k]
                start = clock if clock >= ready else ready
                clock = end = start + duration
                (fwd_end if forward else bwd_end)[g][k] = end
                if record:
                    runs[s].append((forward, k, chunk, start, end))
                at += 1
            if at > ptr[s]:
                left -= at - ptr[s]
                ptr[s], free[s] = at, clock
                progressed = True
        if not progressed:
            raise PlanError(f"pipeline schedule deadlocked ({p} stages, {v} virtual, {m} "
                            "micro-batches): a bug in the op order")
    return free, runs


@functools.lru_cache(maxsize=64)
def _device_ops(pipe: Pipeline, stage: int, micro_batches: int) -> tuple[tuple[bool, int, int],
                                                                         ...]:
    """`device_ops`, cached (plans try many orders of the same count)."""
    return tuple(device_ops(pipe, stage, micro_batches))


def _padded(seq: list[SlotCost], pipe: Pipeline, cm: Optional[CostModel],
            padding: Optional[SlotCost]) -> list[SlotCost]:
    """``seq`` and the padding micro-batches the schedule runs after it."""
    extra = pipe.micro_batches(len(seq)) - len(seq)
    if extra:
        seq = seq + [padding or padding_cost(cm, len(seq[0].kept))] * extra
    return seq


def _memory(ops: Sequence[Sequence[tuple[bool, int, int]]], seq: Sequence[SlotCost],
            pipe: Pipeline, cm: Optional[CostModel]) -> tuple[list[float], list[float]]:
    """Per stage: the highest memory of any rank in its op order (a chunk's forward adds its
    share of the micro-batch's kept bytes, its backward frees it; the running op's extra bytes on
    top) and the most micro-batches in flight."""
    v = pipe.virtual
    base = cm.memory_model.static_memory + cm.memory_model.reserve if cm is not None else 0.0
    world = len(seq[0].kept)
    shares = {}  # micro-batch -> its kept bytes / V per rank
    peaks, counts = [], []
    for device in ops:
        hold = [0.0] * world
        peak = [0.0] * world
        count = most = 0
        for forward, k, _ in device:
            share = shares.get(k)
            if share is None:
                share = shares[k] = [x / v for x in seq[k].kept]
            if forward:
                count += 1
                hold = list(map(operator.add, hold, share))
                if count > most:
                    most = count
            peak = list(map(max, peak, map(operator.add, hold, seq[k].running)))
            if not forward:
                count -= 1
                hold = list(map(operator.sub, hold, share))
        peaks.append(base + max(peak))
        counts.append(most / v)
    return peaks, counts


def pipeline_lower_bound(work_bound: float, costs: Sequence[SlotCost], pipe: Pipeline,
                         padding: Optional[SlotCost] = None) -> float:
    """No order of these slots (and of the interleaved schedule's ``padding`` micro-batches,
    `simulate_pipeline`; any order of those too) runs in less than the largest of:

    * the stage's work (at least ``work_bound``: the stage cost model's
      `megatron_dcp.plan.simulate.lower_bound`, valid for any plan, plus the padding's) plus
      the fill and drain of the last device: ``(P - 1) / V`` x (the shortest forward + the
      shortest backward) and ``P - 1`` P2P hops each way (before its first op and after its
      last);
    * the longest micro-batch through every stage and back: ``P`` x its time + the hops;
    * the slots' own work plus what stage 0 must idle (1F1B: `_stage0_idle`; interleaved:
      `_stage0_idle_interleaved`).
    """
    if pipe.stages == 1 or not costs:
        return work_bound
    p, v = pipe.stages, pipe.virtual
    slots = len(costs)
    costs = _padded(list(costs), pipe, None, padding)
    work_bound += sum(c.time for c in costs[slots:])
    fill = min(c.forward for c in costs) + min(c.backward for c in costs)
    hop = min(c.p2p for c in costs)
    longest = max(costs, key=lambda c: c.time)
    bound = max(work_bound + (p - 1) * (fill / v + 2 * hop),
                p * longest.time + 2 * (p - 1) * longest.p2p)
    idle = _stage0_idle(costs, p) if v == 1 else _stage0_idle_interleaved(costs, p, v)
    return max(bound, sum(c.time for c in costs) + idle)


def _stage0_idle(costs: Sequence[SlotCost], p: int) -> float:
    """What stage 0 of a 1F1B pipeline idles in any order of ``costs``, at least.

    Stage 0 runs every op and ends last, so the makespan is the slots' work plus its idle time.
    Its window of micro-batch ``k`` (from the end of its forward to the start of its backward)
    lasts at least ``R_k = (P - 1) x (its time + 2 hops)`` (the trip through the later stages
    and back), and in it stage 0 runs exactly the backwards of micro-batches ``k - P + 1 ..
    k - 1`` and the forwards of ``k + 1 .. k + P - 1`` (Megatron's order): the rest is idle.
    Windows of micro-batches ``P`` or more apart are disjoint, and their covers share no op: a
    slot covers one window with its backward, another with its forward, and both (its whole
    time) only between two chosen windows ``P`` apart (at most ``P - 1`` such slots per pair).
    Any ``(q - 1) P + 1`` slots take positions spanning at least ``(q - 1) P``, so ``q`` of them
    are pairwise ``P`` apart: for ``q`` = 1 and 2, the least over the ``q``-subsets of the
    ``(q - 1) P + 1`` slots with the longest trips of (their trips - the largest cover the other
    slots can give, `_largest_cover`)."""
    trip = [(p - 1) * (c.time + 2 * c.p2p) for c in costs]
    by_trip = sorted(range(len(costs)), key=lambda i: (-trip[i], i))
    ranked = [_ranked(costs, key) for key in (lambda c: c.forward, lambda c: c.backward,
                                              lambda c: c.time)]
    idle = 0.0
    for q in (1, 2):
        top = by_trip[:(q - 1) * p + 1]
        if len(top) < (q - 1) * p + 1:
            break
        idle = max(idle, min(
            sum(trip[i] for i in chosen) - _largest_cover(costs, set(chosen), q, p, ranked)
            for chosen in itertools.combinations(top, q)))
    return max(0.0, idle)


def _ranked(costs: Sequence[SlotCost], key: Callable[[SlotCost], float]) -> list[int]:
    """Slot indices by ``key`` of their cost, largest first (ties: lower index first)."""
    return sorted(range(len(costs)), key=lambda i: (-key(costs[i]), i))


def _largest_of(ranked: list[int], count: int, but: set[int]) -> list[int]:
    """The first ``count`` indices of ``ranked`` that are not in ``but``."""
    return list(itertools.islice((i for i in ranked if i not in but), count))


def _stage0_idle_interleaved(costs: Sequence[SlotCost], p: int, v: int) -> float:
    """What stage 0 of an interleaved pipeline (``V`` > 1, groups of ``P``) idles in any order
    of ``costs`` (the padded count), at least: one window, as `_stage0_idle` with ``q = 1``.

    The window of micro-batch ``k`` runs on stage 0 from the end of the forward of its last
    chunk (table entry ``i``) to the start of that chunk's backward (backward entry ``j``): it
    lasts at least ``R_k = (P - 1) x (its time / V + 2 hops)`` (that chunk through the later
    stages and back). Stage 0 runs, inside it, the forwards of table entries ``i + 1 .. W + j``
    and the backwards ``i - W .. j - 1`` (``W``: its warm-up count, clipped at both ends). In
    every group of ``L >= P`` micro-batches ``i - j = (V - 1) L >= (V - 1) P`` and ``W <= 2 (P -
    1) + (V - 1) P``, so at most ``2 (P - 1)`` chunk forwards and ``2 (P - 1)`` chunk backwards:
    forwards only of later micro-batches and backwards only of earlier ones (the table is
    chunk-major within a group, groups in order), so no slot gives both; and a micro-batch's
    entries lie ``L >= P`` apart in the table, so at most two of its chunks (each ``1 / V`` of
    its forward or backward) in one window. Stage 0 runs every chunk of every micro-batch, so
    the makespan is at least their work plus ``R_k`` less the largest such cover from the other
    slots, for every ``k`` (tried: the ``TRIPS_TRIED`` longest trips).

    Two windows (1F1B's second case) are not carried over: a slot's ``V`` chunk forwards can
    cover different windows, and two windows are disjoint only about ``(W + 1) / 2`` table
    entries apart rather than ``P`` micro-batches, so the pairing argument needs another count."""
    trip = [(p - 1) * (c.time / v + 2 * c.p2p) for c in costs]
    seats, per_slot = 2 * (p - 1), min(2, v)
    ranked = [_ranked(costs, lambda c: c.forward), _ranked(costs, lambda c: c.backward)]
    idle = 0.0
    for k in sorted(range(len(costs)), key=lambda i: (-trip[i], i))[:TRIPS_TRIED]:
        rest: set[int] = set()  # the 2 x seats largest by forward and by backward: enough
        for order in ranked:
            rest.update(_largest_of(order, 2 * seats, {k}))
        best = {(0, 0): 0.0}  # (forward chunks, backward chunks) used -> largest cover
        for i in sorted(rest):
            f, b = costs[i].forward / v, costs[i].backward / v
            step = dict(best)
            for (nf, nb), value in best.items():
                for n in range(1, per_slot + 1):
                    for key, gain in (((nf + n, nb), n * f), ((nf, nb + n), n * b)):
                        if max(key) <= seats and step.get(key, -1.0) < value + gain:
                            step[key] = value + gain
            best = step
        idle = max(idle, trip[k] - max(best.values()))
    return idle


def _largest_cover(costs: Sequence[SlotCost], chosen: set[int], q: int, p: int,
                   ranked: list[list[int]]) -> float:
    """The most work the slots outside ``chosen`` can run inside ``q`` windows (see
    `_stage0_idle`): at most ``q (P - 1)`` backwards and ``q (P - 1)`` forwards, of distinct
    slots except at most ``(q - 1)(P - 1)`` slots that give both. Exact (a small knapsack over
    the slots that can matter: the ``2 q (P - 1)`` largest by forward, backward and time;
    ``ranked``: every slot in those three orders, `_ranked`)."""
    seats, k = q * (p - 1), 2 * q * (p - 1)
    keep: set[int] = set()
    for order in ranked:
        keep.update(_largest_of(order, k, chosen))
    best = {(0, 0, 0): 0.0}  # (backwards, forwards, both) used -> largest cover
    for i in sorted(keep):
        f, b = costs[i].forward, costs[i].backward
        step = dict(best)
        for (nb, nf, nboth), value in best.items():
            for db, df, dboth, gain in ((1, 0, 0, b), (0, 1, 0, f), (1, 1, 1, f + b)):
                key = (nb + db, nf + df, nboth + dboth)
                if key[0] <= seats and key[1] <= seats and key[2] <= (q - 1) * (p - 1) \
                        and step.get(key, -1.0) < value + gain:
                    step[key] = value + gain
        best = step
    return max(best.values())


def _organ(order: list[int]) -> list[int]:
    """Shortest at both ends, longest in the middle (``order``: shortest first)."""
    front, back = [], []
    for j, i in enumerate(order):
        (front if j % 2 == 0 else back).append(i)
    return front + back[::-1]


def _alternate(order: list[int]) -> list[int]:
    """Largest, smallest, second largest, ... (``order``: largest first): a window of
    consecutive slots mixes large and small (memory)."""
    out, lo, hi = [], 0, len(order) - 1
    while lo <= hi:
        out.append(order[lo])
        if lo != hi:
            out.append(order[hi])
        lo, hi = lo + 1, hi - 1
    return out


def best_order(costs: Sequence[SlotCost], pipe: Pipeline, cm: Optional[CostModel] = None,
               evaluations: int = ORDER_EVALUATIONS, padding: Optional[SlotCost] = None,
               memory: bool = True) -> tuple[list[int], PipelineResult]:
    """The order of ``costs`` with the shortest simulated makespan among those that fit memory:
    as given, by time (both ways), shortest at both ends, large and small alternating by memory,
    then swaps of two slots that shorten it, within ``evaluations`` simulations (any
    ``padding`` after the slots, ``memory``: `simulate_pipeline`). `PlanError` when no order
    tried fits."""
    m = len(costs)
    by_time = sorted(range(m), key=lambda i: (costs[i].time, i))
    by_bytes = sorted(range(m), key=lambda i: (-max(costs[i].kept), i))
    fixed = [list(range(m)), by_time, by_time[::-1], _organ(by_time), _alternate(by_bytes),
             _organ(_alternate(by_bytes))]
    best: Optional[tuple[float, list[int], PipelineResult]] = None
    seen: set[tuple[int, ...]] = set()
    used = 0

    def consider(order: list[int]) -> bool:
        nonlocal best, used
        key = tuple(order)
        if key in seen or used >= evaluations:
            return False
        seen.add(key)
        used += 1
        result = simulate_pipeline(costs, pipe, cm, order, padding, memory)
        if result.fits and (best is None or result.makespan_s < best[0] * (1 - 1e-12)):
            best = (result.makespan_s, list(order), result)
            return True
        return False

    for order in fixed:
        consider(order)
    if best is None:
        raise PlanError(f"no order of the {m} micro-batches fits the in-flight memory of a "
                        f"{pipe.stages}-stage pipeline (stage 0 holds {pipe.held(0, m):g})")
    improved = True
    while improved and used < evaluations:
        improved = False
        current = best[1]
        # the ends of the order decide the fill and the drain: try the shortest slots there
        for a, b in [(0, j) for j in range(1, m)] + [(m - 1, j) for j in range(m - 1)]:
            swapped = list(current)
            swapped[a], swapped[b] = swapped[b], swapped[a]
            if consider(swapped):
                improved = True
                break
    return best[1], best[2]


BOUND_SLACK = 1e-9
"""Relative rounding allowed between `pipeline_lower_bound` and a simulated makespan."""


def shortest_candidate(candidates: Sequence[Sequence[SlotCost]], pipe: Pipeline,
                       padding: Optional[SlotCost] = None) -> int:
    """The index of the first candidate (the slots of a plan) with the shortest simulated
    makespan under its best fixed order (`best_order` with ``FIXED_ORDERS``, memory left out).
    Candidates are simulated by their `pipeline_lower_bound`, least first; once a bound exceeds
    the best makespan found, that candidate and the rest cannot win and are not simulated."""
    bounds = [pipeline_lower_bound(0.0, c, pipe, padding) for c in candidates]
    best: Optional[tuple[float, int]] = None
    for i in sorted(range(len(candidates)), key=lambda i: (bounds[i], i)):
        if best is not None and bounds[i] > best[0] * (1 + BOUND_SLACK):
            break
        span = best_order(candidates[i], pipe, evaluations=FIXED_ORDERS, padding=padding,
                          memory=False)[1].makespan_s
        best = min(best or (span, i), (span, i))
    if best is None:
        raise PlanError("no candidate plan to choose from")
    return best[1]


def reorder(plan: Plan, order: Sequence[int], cm: CostModel) -> Plan:
    """``plan`` with its slots in ``order`` (new slot ``k`` is old slot ``order[k]``), starts
    re-timed slot after slot and task ids in the new order."""
    new_of = {old: k for k, old in enumerate(order)}
    depths = plan.slot_recompute_layers()
    length = [cm.time_model.slot_time(c) for c in depths]
    for t in plan.tasks:
        length[t.slot] = max(length[t.slot], t.duration)
    starts, clock = [], 0.0
    for old in order:
        starts.append(clock)
        clock += length[old]
    moved = sorted((replace(t, slot=new_of[t.slot], start=starts[new_of[t.slot]])
                    for t in plan.tasks), key=lambda t: (t.slot, t.ranks[0]))
    tasks = tuple(replace(t, id=i) for i, t in enumerate(moved))
    return replace(plan, tasks=tasks, meta=dict(plan.meta))


def order_slots(plan: Plan, cm: CostModel, pipe: Pipeline) -> tuple[Plan, PipelineResult]:
    """The bubble-aware post-pass: ``plan`` with its slots in `best_order` for ``pipe`` under
    the stage cost model ``cm`` (memory against its budget), and that order's result."""
    costs = slot_costs(plan, cm)
    order, result = best_order(costs, pipe, cm)
    if order == list(range(len(costs))):
        return plan, result
    return reorder(plan, order, cm), result
