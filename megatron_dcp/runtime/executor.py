"""This rank's work of a plan: the micro-steps `PlanWork` yields, with an exact loss weighting.

For each task of this rank, in plan order ``(start, id)``, `PlanWork` yields a `MicroStep`:

1. the task's `ShardLayout` and this rank's shard of the packed input ids, position ids and
   labels, with the task itself (`Shard`). Labels are computed on each *whole* sequence before
   sharding (next-token targets, or each token its own with a `megatron_dcp.runtime.targets.SelfTargetBatch`); padding gets
   -100;
2. the per-token loss weights (`megatron_dcp.runtime.targets`: ``1 / T`` of the global batch's
   target tokens, or ``1 / (S * targets of the sequence)``), so that the SUM of gradients over
   the DCP world equals the gradient of single-device training on the whole batch
   (`PlanWork.loss` applies them to what the model returned).

An *empty micro-step* (`PlanWork.empty_step`, the one place of the rule) contributes nothing
and joins the collectives a micro-step issues: ``task`` None, a two-token shard on this rank
alone (no target) with the recomputed layers of its slot, its loss multiplied by zero. It fills a
lockstep plan's slots where this rank has no task, pads the rank's count up to
``min_micro_steps`` (an engine that needs equal counts), and pads a pipeline schedule's
micro-batches (`megatron_dcp.megatron.pipeline_engine`). The caller
(`megatron_dcp.runtime.step.StepDriver`, or `run_plan` for plain torch) runs forward, loss and
backward of each and reports it with `PlanWork.record`; the model gets the task as an argument
(``shard.task``), nothing is looked up.

Before anything else one tiny collective checks that every rank holds the same plan, the same DCP
configuration and the same global batch (`megatron_dcp.runtime.digests.check_plan`). Gradient
reduction is left to the engine; `reduce_gradients` does it for plain torch (SUM over the DCP
world, once per step, also on a rank that ran no task).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dcp.config import IGNORE_INDEX, LOSS_REDUCTIONS
from megatron_dcp.plan.plan import EMPTY_STEP_TOKENS, Plan, Task
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.digests import check_plan, local_problems
from megatron_dcp.runtime.groups import GroupPool, comm_device
from megatron_dcp.runtime.layout import ShardLayout
from megatron_dcp.runtime.targets import LossWeights, batch_targets, weighted_loss


class TaskError(RuntimeError):
    """A task failed on this rank; the message names the rank, the task and its sequences."""

    def __init__(self, rank: int, task: Task, lengths: Sequence[int], cause: BaseException) -> None:
        self.rank, self.task = rank, task
        text = str(cause)
        hint = ""
        if "timed out" in text.lower() or "timeout" in text.lower():
            hint = (f" (a collective of this task timed out: another rank of ranks {task.ranks} "
                    "did not reach it: it failed earlier, runs another plan, or is too slow)")
        seqs = ", ".join(f"{s} ({lengths[s]} tokens)" for s in task.seqs[:8])
        more = f", ... {len(task.seqs)} in all" if len(task.seqs) > 8 else ""
        super().__init__(
            f"rank {rank}: task {task.id} (ranks {task.ranks}, ulysses {task.ulysses} x ring "
            f"{task.ring}, recompute_layers {task.recompute_layers}; sequences {seqs}{more}) "
            f"failed{hint}: {type(cause).__name__}: {text}")


@dataclass
class TaskStats:
    """What one task did on this rank and how long it took."""

    task_id: int
    degree: int
    ulysses: int
    ring: int
    recompute_layers: int
    num_seqs: int
    tokens: int
    """Tokens of the task's sequences (whole task, unpadded)."""
    local_tokens: int
    """Rows of this rank's shard (padding included)."""
    forward_s: float
    backward_s: float
    predicted_s: float
    """The plan's predicted duration (``Task.duration``)."""

    @property
    def total_s(self) -> float:
        """Forward plus backward seconds."""
        return self.forward_s + self.backward_s


@dataclass
class StepStats:
    """Result of `run_plan` on one rank."""

    loss: float
    """Loss of the global batch (the reduced value being optimised; all-reduced over ranks)."""
    tokens: int
    """Target tokens of the global batch (``T``)."""
    local_loss: float
    """This rank's share of ``loss`` (0 for a rank with no task)."""
    local_tokens: int
    """Target tokens in this rank's shards."""
    tasks: list[TaskStats] = field(default_factory=list)
    wall_s: float = 0.0
    digest: str = ""
    groups_created: int = 0


# ---------------------------------------------------------------------- building shards
def _shard_inputs(task: Task, layout: ShardLayout, sequences: Sequence[torch.Tensor],
                  loss: LossWeights, device: Optional[torch.device]) -> tuple[torch.Tensor, ...]:
    """This rank's shard of a task: host labels, then device ids, positions, labels, weights."""
    ids, labels, weights = loss.packed(task, sequences)
    labels_host = layout.shard(labels, IGNORE_INDEX)
    return (labels_host, _to_device(layout.shard(ids, 0), device),
            _to_device(layout.position_ids, device), _to_device(labels_host, device),
            _to_device(layout.shard(weights, 0.0), device))


def _to_device(x: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """Host tensor -> ``device``: pinned and asynchronous on CUDA."""
    if device is None or device.type == "cpu":
        return x
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


# ---------------------------------------------------------------------- timing
class Clock:
    """Marks in time without a host sync per mark, and the seconds between them: on CUDA
    (``cuda``) events recorded on the current stream, read once at the end (one synchronize);
    elsewhere ``perf_counter`` (CPU ops are synchronous). The one clock of a step: `PlanWork`
    times its tasks with one, the Megatron pipeline's ``SlotTimers`` each timer name with one."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda and self.marks:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _task_stats(task: Task, layout: ShardLayout, forward_s: float,
                backward_s: float) -> TaskStats:
    """`TaskStats` of one task run on this rank with its shard ``layout``."""
    return TaskStats(task.id, task.degree, task.ulysses, task.ring, task.recompute_layers,
                     len(task.seqs), layout.num_packed, layout.num_tokens, forward_s,
                     backward_s, task.duration)


# ---------------------------------------------------------------------- the work of this rank
@dataclass
class Shard:
    """The input of one micro-step on this rank: its shard of a task, and the task."""

    input_ids: torch.Tensor
    """``[T]`` token ids."""
    position_ids: torch.Tensor
    """``[T]`` positions within each token's own sequence (RoPE must use these)."""
    labels: torch.Tensor
    """``[T]`` targets; ``IGNORE_INDEX`` where there is none."""
    task: Optional[TaskContext]
    """The task this shard belongs to: pass it to the model (``model(..., task=shard.task)``),
    so attention, positions and recompute follow it on whatever thread they run."""


@dataclass
class MicroStep:
    """One micro-step of this rank, as `PlanWork` yields it."""

    task: Optional[Task]
    """The plan's task; ``None``: an empty micro-step (no gradient, the same collectives)."""
    shard: Shard
    """The input (an empty micro-step: two tokens on this rank alone, `PlanWork.empty_step`)."""
    weights: Optional[torch.Tensor]
    """Per-token loss weights of the shard (``None`` for an empty micro-step)."""
    last: bool
    """The rank's last micro-step of the step (the accumulation boundary)."""
    layout: Optional[ShardLayout] = None
    tokens: int = 0
    """Target tokens of the shard."""


class PlanWork:
    """This rank's micro-steps of ``plan``, in plan order: iterate to get them (`MicroStep`).

    Constructing it is collective over the job (the plan check: the same plan, ``config`` and
    batch on every rank, `megatron_dcp.runtime.digests.check_plan`) and creates the plan's
    missing groups. ``sequences``: the global batch (1-D token ids, host tensors preferred;
    entries no task of this rank uses may be ``None``); ``max_position``: checked for every
    sequence before any task runs; ``device``: where shards go (default: the host);
    ``targets``: ``"next"`` or ``"self"`` (default: the batch's own kind, `batch_targets`);
    ``min_micro_steps``: pad with empty micro-steps up to this count.
    Nothing in the loop waits for the device (host-built shards, asynchronous copies,
    CUDA-event timings).

    Per micro-step the caller runs forward, `loss` and backward, then reports it once with
    `record` (its weighted loss and, when it timed it itself, its seconds); inside `running`
    the micro-step is timed here and a failure names the task.
    """

    def __init__(self, plan: Plan, sequences: Sequence[Optional[torch.Tensor]], rank: int, *,
                 pool: GroupPool, config: Any = None, loss_reduction: str = "token",
                 max_position: Optional[int] = None, device: Optional[torch.device] = None,
                 targets: Optional[str] = None, min_micro_steps: int = 0) -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction={loss_reduction!r}: must be one of "
                             f"{LOSS_REDUCTIONS}")
        self.t_start = time.perf_counter()
        self.plan, self.sequences, self.rank = plan, sequences, rank
        self.pool, self.loss_reduction = pool, loss_reduction
        self.targets = batch_targets(sequences, targets)
        self.comm_device = comm_device(pool.world_group)
        """Where this step's collectives take their tensors (`comm_device`: never the host on
        NCCL, whatever ``device`` says)."""
        self.on_cuda = self.comm_device.type == "cuda"
        # the shards' device: the one given, else the job's on CUDA (host shards would meet a
        # model on the GPU), else the host
        self.device = torch.device(device) if device is not None else \
            (self.comm_device if self.on_cuda else None)
        self.digest = check_plan(plan, pool, local_problems(plan, sequences, rank, max_position),
                                 self.comm_device, sequences=sequences, config=config)
        self.groups_created = pool.ensure(plan)
        self.weights = LossWeights(plan, sequences, loss_reduction, self.targets)
        """Every target's loss weight (`LossWeights`)."""
        self.total = self.weights.total
        """T of the per-token loss: the global batch's sum of target weights."""
        self.trained = self.weights.trained
        """The global batch's targets with a non-zero weight (tokens trained)."""
        self.per_token = self.weights.per_token
        """Whether the model must return per-token losses (`LossWeights.per_token`)."""
        self.order = _rank_order(plan, rank)
        self.micro_steps = max(len(self.order), min_micro_steps)
        """This rank's micro-steps, empty ones included."""
        self.local_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        """This rank's share of the global loss: the sum of the weighted losses recorded."""
        self.local_tokens = 0
        """Target tokens of the tasks whose loss was recorded."""
        self.task_losses: list[tuple[int, torch.Tensor]] = []
        """``(task id, weighted loss)`` of every task recorded: checked for non-finite values
        once, after the step (one host sync)."""
        self._clock = Clock(self.on_cuda)
        self._timing: Optional[MicroStep] = None  # the micro-step inside `running`
        self._timed: list[MicroStep] = []  # timed by `running`, in order
        self._ran: list[tuple[MicroStep, Optional[float], Optional[float]]] = []

    def __iter__(self) -> Iterator[MicroStep]:
        for i in range(self.micro_steps):
            last = i == self.micro_steps - 1
            task, layers, tiles = self.order[i] if i < len(self.order) else (None, 0, 1)
            if task is None:
                yield self.empty_step(layers, last, mlp_tiles=tiles)
            else:
                yield self._task_step(task, last)

    def _task_step(self, task: Task, last: bool) -> MicroStep:
        try:
            layout = ShardLayout.build([self.plan.lengths[s] for s in task.seqs], task.ulysses,
                                       task.ring, task.ranks.index(self.rank))
            labels_host, ids, positions, labels, weights = _shard_inputs(
                task, layout, self.sequences, self.weights, self.device)
            ctx = self.pool.context_for(task, self.rank, layout)
            ctx.sequence_weights = tuple(self.weights.per_target[s] for s in task.seqs)
        except Exception as exc:  # noqa: BLE001 - re-raised with rank / task / sequences
            raise TaskError(self.rank, task, self.plan.lengths, exc) from exc
        tokens = int((labels_host != IGNORE_INDEX).sum())
        return MicroStep(task, Shard(ids, positions, labels, ctx), weights, last, layout, tokens)

    def empty_step(self, recompute_layers: int = 0, last: bool = False,
                   mlp_tiles: int = 1) -> MicroStep:
        """An empty micro-step: a task of `EMPTY_STEP_TOKENS` tokens on this rank alone, no target, that recomputes
        ``recompute_layers`` and runs its MLP over ``mlp_tiles`` tiles (its slot's: its loss is
        multiplied by zero: no gradient, the same modules and collectives as a task's
        micro-step)."""
        task = Task(id=-1, ranks=(self.rank,), seqs=(-1,), recompute_layers=recompute_layers,
                    mlp_tiles=mlp_tiles)
        n = EMPTY_STEP_TOKENS
        ctx = self.pool.context_for(task, self.rank, ShardLayout.build([n], 1, 1, 0))
        ctx.sequence_weights = (0.0,)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device)
        labels = torch.full((n,), IGNORE_INDEX, dtype=torch.long, device=self.device)
        return MicroStep(None, Shard(ids, positions, labels, ctx), None, last)

    @contextmanager
    def running(self, step: MicroStep) -> Iterator[MicroStep]:
        """Around a micro-step's forward, loss and backward: times a task's micro-step and
        re-raises its failure as a `TaskError` naming the rank, the task and its sequences."""
        if step.task is None:
            yield step
            return
        self._clock.mark()
        self._timing = step
        try:
            yield step
        except Exception as exc:  # noqa: BLE001 - re-raised with rank / task / sequences
            raise TaskError(self.rank, step.task, self.plan.lengths, exc) from exc
        finally:
            self._timing = None
        self._clock.mark()
        self._timed.append(step)

    def loss(self, step: MicroStep, out: torch.Tensor) -> torch.Tensor:
        """The weighted loss of a micro-step from what the model returned for its shard (the
        summed token losses, or per-token losses ``[T]``): the loss to run backward on (inside
        `running`, the end of the micro-step's forward). An empty micro-step's is
        ``0 * out.sum()`` (the graph of a real one, no gradient)."""
        if step.task is None:
            return out.sum() * 0.0
        loss = weighted_loss(out, step.shard.labels, step.weights, self.weights)
        if self._timing is step:
            self._clock.mark()
        return loss

    def record(self, step: MicroStep, loss: Optional[torch.Tensor],
               forward_s: Optional[float] = None, backward_s: Optional[float] = None) -> None:
        """Report one micro-step once it ran: its weighted loss (`loss`; ``None`` where this
        rank computed none, a pipeline stage before the last) and its forward and backward
        seconds (``None``: timed by `running`, or not at all). The one call per micro-step an
        engine that runs its own schedule makes; an empty micro-step is ignored."""
        if step.task is None:
            return
        if loss is not None:
            loss = loss.detach()
            self.local_loss = self.local_loss + loss.to(torch.float64)
            self.task_losses.append((step.task.id, loss))
            self.local_tokens += step.tokens
        self._ran.append((step, forward_s, backward_s))

    def _task_stats(self) -> list[TaskStats]:
        """`TaskStats` of the tasks recorded with a time: their own seconds, else the clock's
        (forward, backward, between: three gaps per micro-step timed by `running`); a task
        timed by neither (a schedule whose timers did not pair up) has none."""
        gaps = self._clock.seconds()
        timed = {id(step): i for i, step in enumerate(self._timed)}
        out = []
        for step, forward_s, backward_s in self._ran:
            if forward_s is None and id(step) in timed:
                i = timed[id(step)]
                forward_s, backward_s = gaps[3 * i], gaps[3 * i + 1]
            if forward_s is not None:
                out.append(_task_stats(step.task, step.layout, forward_s, backward_s or 0.0))
        return out

    def stats(self, loss: Optional[float] = None) -> StepStats:
        """`StepStats` of the micro-steps run (``loss``: the global loss; default: this
        rank's)."""
        local = float(self.local_loss)
        return StepStats(loss=local if loss is None else loss, tokens=self.trained,
                         local_loss=local, local_tokens=self.local_tokens,
                         tasks=self._task_stats(),
                         wall_s=time.perf_counter() - self.t_start, digest=self.digest,
                         groups_created=self.groups_created)


def _rank_order(plan: Plan, rank: int) -> list[tuple[Optional[Task], int, int]]:
    """``(task, recompute_layers, mlp_tiles)`` of this rank's micro-steps in plan order; in a
    lockstep plan ``(None, the slot's recompute_layers, the slot's mlp_tiles)`` for each slot
    where this rank has no task: what its empty micro-step runs."""
    slots = list(zip(plan.slot_recompute_layers(), plan.slot_mlp_tiles()))  # [] for a free plan
    order: list[tuple[Optional[Task], int, int]] = []
    next_slot = 0
    for task in plan.tasks_for_rank(rank):
        if slots:
            order += [(None, layers, tiles) for layers, tiles in slots[next_slot:task.slot]]
            next_slot = task.slot + 1
        order.append((task, task.recompute_layers, task.mlp_tiles))
    return order + [(None, layers, tiles) for layers, tiles in slots[next_slot:]]


def run_plan(plan: Plan, sequences: Sequence[Optional[torch.Tensor]], rank: int,
             forward_step: Callable[[Shard], torch.Tensor], *, pool: GroupPool,
             backward: Optional[Callable[[torch.Tensor], Any]] = None,
             **work: Any) -> StepStats:
    """Run DCP rank ``rank``'s micro-steps of ``plan`` (forward + backward) in a plain torch
    loop: `PlanWork` (``work``: its keyword arguments) over ``forward_step(shard)``, which passes
    ``shard.task`` on to the model and returns the summed token losses (labels -100 ignored) or
    per-token losses ``[T_local]`` (needed for ``loss_reduction="sequence"``); ``backward``
    defaults to ``loss.backward()``. Collective over the DCP world of ``pool``, once per step on
    every rank; the returned loss is the global one. Gradients are not reduced here
    (`reduce_gradients`)."""
    steps = PlanWork(plan, sequences, rank, pool=pool, **work)
    backward = backward or (lambda loss: loss.backward())
    for step in steps:
        with steps.running(step):
            loss = steps.loss(step, forward_step(step.shard))
            backward(loss)
        steps.record(step, loss)
    return steps.stats(global_sum(float(steps.local_loss), pool.world_group, steps.comm_device))


def global_sum(value: float, group: Any, device: Optional[torch.device] = None) -> float:
    """SUM of a float over ``group`` (one tiny all-reduce; ``device``: CUDA for NCCL)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t[0])


def reduce_gradients(params: Sequence[torch.nn.Parameter], group: Any = None) -> None:
    """SUM all-reduce the gradients of ``params`` over ``group`` (the DCP world), coalesced.

    A parameter without a gradient (a rank with no task, or an unused parameter) contributes
    zeros and receives the sum. Call exactly once per step on every rank.
    """
    params = [p for p in params if p.requires_grad]
    buckets: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for _, members in sorted(buckets.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([p.grad.reshape(-1) for p in members])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in members:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
