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

The order of the slots (the bubble-aware post-pass) is `megatron_dcp.plan.pipeline_order`'s.

Model simplifications: a forward is ``1 / (3 + c/N)`` of a slot's stage time and the backward the
rest (the cost model's passes); every stage counts the embedding and the head in its time and
parameters (the stage shape keeps them: conservative), the logits and loss in memory only on the
last stage (`SlotCost.head`); P2P sends each rank's local tokens x hidden in bf16
over the inter-node link, hidden behind nothing: every tensor-parallel rank sends the whole
activation, or with sequence parallelism (``model.sequence_parallel``) its 1/TP of the tokens
(the shard padded to a multiple of TP, as the runtime pads it).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Sequence

from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.memory import BF16, MLP_GRAD_FRACTION
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import EMPTY_STEP_TOKENS, Plan, PlanError, padded_length

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
    kept, conservatively), without pipeline fields; the model itself when ``P == 1``. A MoE
    model's stage keeps the leading dense layers the last stage has (usually none: its layers
    are all MoE layers, the most expensive kind)."""
    if model.pipeline_parallel == 1 and model.virtual_pipeline == 1:
        return model
    per_stage = model.layers_per_stage
    if model.is_moe:
        dense = max(0, model.moe_dense_layers - (model.num_layers - per_stage))
        return replace(model, num_layers=per_stage, pipeline_parallel=1, virtual_pipeline=1,
                       moe_dense_layers=dense)
    return replace(model, num_layers=per_stage, pipeline_parallel=1, virtual_pipeline=1)


def micro_batch_cost_model(cm: CostModel, pipe: Pipeline, share: float = 1.0) -> CostModel:
    """``cm`` with the budget of one micro-batch: static memory and reserve plus ``share`` /
    `Pipeline.held` (stage 0) of what is left for activations, so that the micro-batches stage 0
    holds fit together in any order (``share`` 1.0)."""
    mem = cm.memory_model
    free = mem.budget - mem.static_memory - mem.reserve
    budget = mem.static_memory + mem.reserve + free * share / pipe.held(0)
    out = CostModel(cm.model, cm.hw, world_size=cm.world_size, zero_stage=cm.zero_stage,
                    ranks_per_node=cm.ranks_per_node, memory_budget=budget,
                    attention_layout=cm.attention_layout, ulysses_scope=cm.ulysses_scope,
                    communicators=mem.communicators)
    out.memory_model.max_tokens_per_rank = mem.max_tokens_per_rank
    return out


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
    """Bytes per rank needed on top while it runs on any stage (the recompute buffer)."""
    head: list[float] = field(default_factory=list)
    """Bytes per rank on top while it runs on the last stage only (the last virtual stage's
    chunk): the logits and loss, the model's ends (`MemoryModel.logit_bytes`, ``ends_bytes``),
    less the layer backward's workspace that ``running`` counts (the two never overlap)."""

    @property
    def time(self) -> float:
        """Forward and backward."""
        return self.forward + self.backward


def slot_costs(plan: Plan, cm: CostModel) -> list[SlotCost]:
    """The stage cost of every slot of a lockstep ``plan`` under the stage cost model ``cm``: its
    duration as the simulator's (the longest task, at least `TimeModel.slot_time`), split into
    forward and backward; P2P and memory from each rank's local tokens (an idle rank runs an
    empty micro-step: nothing held)."""
    if not plan.lockstep:
        raise PlanError("a pipeline runs lockstep plans only (slots are its micro-batches)")
    depths = plan.slot_recompute_layers()
    world = plan.world_size
    durations = cm.time_model.slot_durations(depths, (
        (t.slot, cm.time_model.task_time(t, plan.lengths, plan.frame_tokens)) for t in plan.tasks))
    local = [[0] * world for _ in depths]
    for t in plan.tasks:
        tokens = sum(padded_length(plan.lengths[s], t.ulysses, t.ring) for s in t.seqs)
        for r in t.ranks:
            local[t.slot][r] = math.ceil(tokens / len(t.ranks))
    n = cm.model.num_layers
    costs = []
    for k, c in enumerate(depths):
        forward = durations[k] / (3.0 + c / n)
        mm = cm.memory_model
        kept, head = mm.kept_token_bytes(c), mm.logit_bytes + mm.ends_bytes
        # a layer's backward (the MLP's gradients, three hidden-wide ones) and the P2P buffers
        # (the received activation or gradient, the one sent): where no loss runs, the peak
        bwd = MLP_GRAD_FRACTION * mm.mlp_token_bytes + 5 * mm.recomputed_layer_bytes
        run = mm.token_bytes(c) - kept - head + bwd
        costs.append(SlotCost(forward, durations[k] - forward, p2p_time(max(local[k]), cm),
                              [x * kept for x in local[k]], [x * run for x in local[k]],
                              [x * max(0.0, head - bwd) for x in local[k]]))
    return costs


def p2p_time(tokens: int, cm: CostModel) -> float:
    """Seconds to send the activations of ``tokens`` local tokens to the next stage: hidden x
    bf16 per token over the inter-node link; with sequence parallelism each tensor-parallel rank
    sends its 1/TP of them (the shard padded to a multiple of TP)."""
    m = cm.model
    if m.sequence_parallel and m.tensor_parallel > 1:
        tokens = math.ceil(tokens / m.tensor_parallel)
    return tokens * m.hidden_size * BF16 / cm.hw.inter_bandwidth + cm.hw.inter_latency


def padding_cost(cm: Optional[CostModel], world: int) -> SlotCost:
    """One empty micro-batch that pads the interleaved schedule (`Pipeline.micro_batches`):
    ``EMPTY_STEP_TOKENS`` on every rank, no recompute, as long as the shortest slot
    (`TimeModel.slot_time`); nothing at all without a cost model."""
    if cm is None:
        return SlotCost(0.0, 0.0, 0.0, [0.0] * world, [0.0] * world)
    duration = cm.time_model.slot_duration(0)
    kept, total = cm.memory_model.kept_token_bytes(0), cm.memory_model.token_bytes(0)
    forward = duration / 3.0
    return SlotCost(forward, duration - forward, p2p_time(EMPTY_STEP_TOKENS, cm),
                    [EMPTY_STEP_TOKENS * kept] * world,
                    [EMPTY_STEP_TOKENS * (total - kept)] * world)


class Op(NamedTuple):
    """One op of a pipeline rank: the forward or backward of a micro-batch's model chunk."""

    forward: bool
    micro_batch: int
    chunk: int


class Run(NamedTuple):
    """An op as `simulate_pipeline` ran it: its start and end (seconds)."""

    op: Op
    start: float
    end: float


def device_ops(pipe: Pipeline, stage: int, micro_batches: int) -> list[Op]:
    """Megatron's op order on pipeline rank ``stage``: warm-up forwards (`Pipeline.warmup`),
    then one forward one backward, then the cool-down backwards; chunks in Megatron's schedule
    table (groups of ``P`` micro-batches, every chunk of a group before the next group; backward
    chunks in reverse)."""
    p, v, m = pipe.stages, pipe.virtual, micro_batches
    table = []
    for first in range(0, m, p):
        group = range(first, m if first + p >= m else first + p)
        table += [(k, chunk) for chunk in range(v) for k in group]
    backward = [(k, v - 1 - chunk) for k, chunk in table]
    total, warm = m * v, pipe.warmup(stage, m)
    ops = [Op(True, *table[i]) for i in range(warm)]
    for i in range(total - warm):
        ops += [Op(True, *table[warm + i]), Op(False, *backward[i])]
    ops += [Op(False, *backward[i]) for i in range(total - warm, total)]
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
    ops: list[list[Run]] = field(default_factory=list)
    """Per stage: its ops' runs in run order."""


def simulate_pipeline(costs: Sequence[SlotCost], pipe: Pipeline, cm: Optional[CostModel] = None,
                      order: Optional[Sequence[int]] = None,
                      padding: Optional[SlotCost] = None, memory: bool = True) -> PipelineResult:
    """Run the slots ``costs`` (micro-batch ``k`` is ``costs[order[k]]``; default in order)
    through the schedule (module doc); memory against ``cm``'s budget when given. An
    interleaved schedule runs ``padding`` (default `padding_cost` of ``cm``) after the slots up
    to the count it accepts (`Pipeline.micro_batches`), as the runtime does. ``memory=False``:
    the makespan only (no ``peak_bytes``, ``held`` or ``runs``; ``fits`` left True)."""
    seq = with_padding([costs[i] for i in (order if order is not None else range(len(costs)))],
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


def _run_ops(ops: list[tuple[Op, ...]], seq: Sequence[SlotCost], pipe: Pipeline, record: bool
             ) -> tuple[list[float], list[list[Run]]]:
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
    runs: list[list[Run]] = [[] for _ in range(p)]
    left = sum(len(o) for o in ops)
    while left:
        progressed = False
        for s in range(p):
            device, at, clock = ops[s], ptr[s], free[s]
            while at < len(device):
                op = device[at]
                forward, k = op.forward, op.micro_batch
                g = op.chunk * p + s  # virtual stage
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
                    runs[s].append(Run(op, start, end))
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
def _device_ops(pipe: Pipeline, stage: int, micro_batches: int) -> tuple[Op, ...]:
    """`device_ops`, cached (plans try many orders of the same count)."""
    return tuple(device_ops(pipe, stage, micro_batches))


def with_padding(seq: list[SlotCost], pipe: Pipeline, cm: Optional[CostModel],
                 padding: Optional[SlotCost]) -> list[SlotCost]:
    """``seq`` and the padding micro-batches the schedule runs after it."""
    extra = pipe.micro_batches(len(seq)) - len(seq)
    if extra:
        seq = seq + [padding or padding_cost(cm, len(seq[0].kept))] * extra
    return seq


def _memory(ops: Sequence[Sequence[Op]], seq: Sequence[SlotCost],
            pipe: Pipeline, cm: Optional[CostModel]) -> tuple[list[float], list[float]]:
    """Per stage: the highest memory of any rank in its op order (a chunk's forward adds its
    share of the micro-batch's kept bytes, its backward frees it; the running op's extra bytes on
    top, its logits and loss on the last stage's last chunk only) and the most micro-batches in
    flight."""
    v, last = pipe.virtual, len(ops) - 1
    base = cm.memory_model.static_memory + cm.memory_model.reserve if cm is not None else 0.0
    world = len(seq[0].kept)
    shares = {}  # micro-batch -> its kept bytes / V per rank
    peaks, counts = [], []
    for stage, device in enumerate(ops):
        hold = [0.0] * world
        peak = [0.0] * world
        count = most = 0
        for op in device:
            k = op.micro_batch
            share = shares.get(k)
            if share is None:
                share = shares[k] = [x / v for x in seq[k].kept]
            if op.forward:
                count += 1
                hold = list(map(operator.add, hold, share))
                if count > most:
                    most = count
            running = seq[k].running
            if seq[k].head and stage == last and op.chunk == v - 1:  # logits, loss, ends
                running = list(map(operator.add, running, seq[k].head))
            peak = list(map(max, peak, map(operator.add, hold, running)))
            if not op.forward:
                count -= 1
                hold = list(map(operator.sub, hold, share))
        peaks.append(base + max(peak))
        counts.append(most / v)
    return peaks, counts
