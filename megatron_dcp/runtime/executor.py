"""`run_plan`: run this rank's tasks of a plan, with an exact per-token (or per-sequence) loss.

For each task of this rank, in plan order ``(start, id)``:

1. build the task's `ShardLayout` and cut this rank's shard of the packed input ids, position ids,
   labels and loss weights. Labels are next-token targets computed on each *whole* sequence before
   sharding, so the last token of a shard keeps its target from the next shard; a sequence's last
   token and padding get -100. With ``targets="self"`` (a `SelfTargetBatch`: every token is its
   own target, e.g. the latent rows of a video diffusion model) the label of a token is its own
   id, only padding gets -100, and all ``n`` tokens of a sequence count as targets;
2. enter the task context (group, sub-groups, layout, checkpoint depth) and call
   ``forward_step(input_ids, position_ids, labels)``;
3. weight the loss: ``token`` reduction scales the summed token losses by ``1 / T``
   (``T = target_count(plan, targets)``, the target tokens of the *global* batch), ``sequence``
   weights every token by ``1 / (S * targets of its sequence)``; the SUM of gradients over the
   DCP world then equals the gradient of single-device training on the whole batch;
4. call ``backward(weighted_loss)`` still inside the task context (recomputation and the
   attention's backward collectives need it).

Before anything else one tiny collective checks that every rank holds the same plan, the same DCP
configuration and the same global batch (digests of each) and that no rank found
a problem in its input; a mismatch raises on every rank, naming the ranks, instead of hanging in a
later collective or training on a wrong loss. Gradient reduction is left to the engine;
`reduce_gradients` does it for plain torch (SUM over the DCP world, once per step, also on a
rank that ran no task).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dcp.config import IGNORE_INDEX, LOSS_REDUCTIONS
from megatron_dcp.plan.cost import PlanError
from megatron_dcp.plan.plan import Plan, Task
from megatron_dcp.plan.validate import validate_plan
from megatron_dcp.runtime.context import task_context
from megatron_dcp.runtime.groups import GroupPool
from megatron_dcp.runtime.layout import ShardLayout


ForwardStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

TARGET_KINDS = ("next", "self")
"""What a token's loss target is: the next token of its sequence, or the token itself."""


class SelfTargetBatch(list):
    """A global batch (a list of 1-D integer tensors) whose every token is its own target.

    The tensors are ids of rows of a table every rank holds (a video diffusion model: rows of the
    batch's latents, noise and timesteps; see `megatron_dcp.data.video.VideoBatch`); the model
    computes a token's loss from its row. `run_plan` (and so `StepDriver.step`, which passes the
    batch on) labels every token with its own id (no shift), gives padding -100, and counts all
    ``n`` tokens of a sequence in the loss normalisation. ``content_digests``: one short digest
    per sequence of what its rows hold (the table), so the plan check compares the content across
    ranks, not only the row ids. ``frame_tokens``: tokens per frame of every sequence (videos of
    their own resolution), which `StepDriver.step` hands to the planner.
    """

    targets = "self"

    def __init__(self, sequences, content_digests: Optional[Sequence[str]] = None,
                 frame_tokens: Optional[Sequence[int]] = None) -> None:
        super().__init__(sequences)
        for name, values in (("content digests", content_digests),
                             ("frame_tokens", frame_tokens)):
            if values is not None and len(values) != len(self):
                raise ValueError(f"SelfTargetBatch: {len(values)} {name} for {len(self)} "
                                 "sequences")
        self.content_digests = list(content_digests) if content_digests is not None else None
        self.frame_tokens = [int(f) for f in frame_tokens] if frame_tokens is not None else None


def batch_targets(sequences: Sequence[Any], targets: Optional[str] = None) -> str:
    """The target kind of a batch: ``targets`` if given, else the batch's own (``"self"`` for a
    `SelfTargetBatch`), else ``"next"``."""
    kind = targets if targets is not None else getattr(sequences, "targets", "next")
    if kind not in TARGET_KINDS:
        raise ValueError(f"targets={kind!r}: must be one of {TARGET_KINDS}")
    return kind


def target_count(plan: Plan, targets: str = "next") -> int:
    """T of the per-token loss: ``plan.target_tokens`` (next-token targets, ``n - 1`` per
    sequence) or, for ``targets="self"``, every token of the sequences the plan runs."""
    if targets == "next":
        return plan.target_tokens
    return sum(plan.lengths[s] for t in plan.tasks for s in t.seqs)


class PlanMismatchError(RuntimeError):
    """Ranks of the DCP world hold different plans (or one of them found bad input)."""


class BatchError(ValueError):
    """The global batch does not fit the plan or the model (names the sequence)."""


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
            f"{task.ring}, recompute_layers {task.recompute_layers}; sequences {seqs}{more}) failed{hint}: "
            f"{type(cause).__name__}: {text}")


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


# ---------------------------------------------------------------------- checks before running
def _digest_pieces(digest: str) -> list[int]:
    """The 64-bit hex digest as 4 non-negative 16-bit integers (exact in any dtype used)."""
    value = int(digest, 16)
    return [(value >> (16 * i)) & 0xFFFF for i in range(4)]


def _local_problems(plan: Plan, sequences: Sequence[Optional[torch.Tensor]], rank: int,
                    max_position: Optional[int]) -> list[str]:
    """Problems this rank can see without talking to the others."""
    problems = []
    if not 0 <= rank < plan.world_size:
        return [f"rank {rank} is outside the plan's world of {plan.world_size} ranks"]
    if len(sequences) != len(plan.lengths):
        return [f"the batch has {len(sequences)} sequences, the plan {len(plan.lengths)}"]
    try:
        # Structure only: hand-written plans may leave start times at 0.
        validate_plan(plan, check_times=False)
    except PlanError as exc:
        return [f"invalid plan: {exc}"]
    for task in plan.tasks:
        for s in task.seqs:
            n = plan.lengths[s]
            if max_position is not None and n > max_position:
                problems.append(f"sequence {s} has {n} tokens, more than the model's "
                                f"max_position {max_position} (task {task.id}, ranks {task.ranks})")
            if rank in task.ranks:
                seq = sequences[s]
                if seq is None or seq.dim() != 1 or seq.shape[0] != n:
                    got = "None" if seq is None else f"shape {tuple(seq.shape)}"
                    problems.append(f"sequence {s} of task {task.id}: the plan says {n} tokens, "
                                    f"the batch holds {got}")
    return problems


def config_digest(config: Any) -> str:
    """64-bit hex digest of a configuration (a `DCPConfig` or a JSON-able dict); ``""`` for None."""
    if config is None:
        return ""
    data = config.to_dict() if hasattr(config, "to_dict") else config
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_NO_OPINION = (1 << 63) - 1
"""Digest slot of a rank that does not hold the whole batch: neutral under MIN."""


def _host_tokens(sequences: Sequence[torch.Tensor]) -> bytes:
    """The bytes of the batch's token ids concatenated as int64 on the host (one copy from a
    device; read without numpy, which a CUDA torch does not require)."""
    device = sequences[0].device
    tokens = torch.cat([s.reshape(-1).to(device=device, dtype=torch.int64)
                        for s in sequences]).cpu().contiguous()
    return ctypes.string_at(tokens.data_ptr(), tokens.numel() * tokens.element_size())


def batch_digest(sequences: Sequence[Optional[torch.Tensor]]) -> Optional[str]:
    """64-bit hex digest (SHA-256) of a global batch's token ids, in batch order (the lengths are
    in the plan digest); None when an entry is missing (a rank that holds only its own sequences
    has no view of the whole batch). Tokens on a device are copied to the host once: about 5 ms
    per million tokens on one CPU core."""
    if not sequences or any(s is None for s in sequences):
        return None
    h = hashlib.sha256(_host_tokens(sequences))
    for extra in getattr(sequences, "content_digests", None) or ():
        h.update(extra.encode())
    return h.hexdigest()[:16]


def sequence_digests(sequences: Sequence[Optional[torch.Tensor]]) -> Optional[list[str]]:
    """`batch_digest` of every sequence on its own (to name the first one that differs)."""
    if not sequences or any(s is None for s in sequences):
        return None
    tokens, out, start = _host_tokens(sequences), [], 0
    extras = getattr(sequences, "content_digests", None) or [""] * len(sequences)
    for s, extra in zip(sequences, extras):
        end = start + 8 * int(s.numel())  # int64 bytes
        h = hashlib.sha256(tokens[start:end])
        h.update(extra.encode())
        out.append(h.hexdigest()[:16])
        start = end
    return out


def check_plan(plan: Plan, pool: GroupPool, problems: Sequence[str] = (),
               device: Optional[torch.device] = None, *,
               sequences: Optional[Sequence[Optional[torch.Tensor]]] = None,
               config: Any = None) -> str:
    """Collective over the job (every DCP world: tensor-parallel peers must run the same plan):
    check every rank holds the same plan, the same ``config``
    (the DCP configuration: ranks that differ, say in ``loss_reduction``, would otherwise train
    on a wrong loss without an error) and the same global batch ``sequences`` (a digest of the
    tokens, and of a `SelfTargetBatch`'s content digests; a rank that lacks some sequences is
    not compared), and that none has problems.

    One all-reduce (MIN) of the digests' pieces, their negatives and the problem flag; only on
    a mismatch a second collective gathers the digests and messages to name the ranks. Raises
    on every rank alike, so no rank is left waiting: `PlanMismatchError` when plans,
    configurations or batches differ, else `BatchError` with every rank's problems (e.g. a
    sequence longer than the model's positions).
    """
    digest = plan.digest()
    settings = config_digest(config)
    # a rank whose batch does not even fit the plan reports that as a problem, not a mismatch
    compare = sequences is not None and not problems
    tokens = batch_digest(sequences) if compare else None
    pieces = _digest_pieces(digest) + _digest_pieces(settings or "0")
    pieces += _digest_pieces(tokens) if tokens else [_NO_OPINION] * 4
    negated = [v if v == _NO_OPINION else -v for v in pieces]
    flag = 1 if problems else 0
    t = torch.tensor(pieces + negated + [-flag], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pool.job_group)
    n = len(pieces)
    merged = t.tolist()
    agree = all(low == -high or low == _NO_OPINION
                for low, high in zip(merged[:n], merged[n:2 * n]))
    if agree and not merged[2 * n]:
        return digest
    report = (digest, settings, config.to_dict() if hasattr(config, "to_dict") else config,
              sequence_digests(sequences) if compare else None, list(problems))
    gathered: list[Any] = [None] * dist.get_world_size(pool.job_group)  # named by job rank
    dist.all_gather_object(gathered, report, group=pool.job_group)
    disagreements = _disagreements(gathered)
    lines = disagreements + [f"rank {r}: {m}" for r, entry in enumerate(gathered)
                             for m in entry[4]]
    error = PlanMismatchError if disagreements else BatchError
    raise error(f"rank {dist.get_rank()}: plan check failed before running any task:\n  "
                + "\n  ".join(lines))


def _odd_ranks(values: list) -> tuple[list[int], Any]:
    """Ranks whose value differs from the majority's (on a tie, the lowest rank's), and it."""
    keys = [json.dumps(v, sort_keys=True, default=str) for v in values]
    common = min(set(keys), key=lambda k: (-keys.count(k), keys.index(k)))
    return [r for r, k in enumerate(keys) if k != common], values[keys.index(common)]


def _disagreements(gathered: list) -> list[str]:
    """One line per kind of disagreement (plan, configuration, batch), naming the ranks."""
    lines = []
    odd, common = _odd_ranks([g[0] for g in gathered])
    if odd:
        lines.append(f"plan digest differs on rank(s) {odd} (theirs: "
                     f"{', '.join(gathered[r][0] for r in odd)}; the other ranks: {common}): "
                     "every rank must build the same plan (same lengths, config, iteration, "
                     "seed)")
    settings = [g[1] for g in gathered]
    odd, common = _odd_ranks(settings)
    if odd:
        reference = gathered[settings.index(common)][2] or {}
        theirs = {r: gathered[r][2] or {} for r in odd}
        fields = sorted(k for k in set(reference).union(*theirs.values())
                        if any(t.get(k) != reference.get(k) for t in theirs.values()))
        shown = "; ".join(f"rank {r}: " + ", ".join(f"{k}={t.get(k)!r}" for k in fields)
                          for r, t in theirs.items())
        others = ", ".join(f"{k}={reference.get(k)!r}" for k in fields)
        lines.append(f"DCP configuration differs on rank(s) {odd} ({shown}; the other ranks: "
                     f"{others}): every rank must run with the same settings")
    holders = [r for r, g in enumerate(gathered) if g[3] is not None]
    if holders:
        odd_local, common_fp = _odd_ranks([gathered[r][3] for r in holders])
        odd = [holders[i] for i in odd_local]
        if odd:
            first = min(next((s for s, (a, b) in enumerate(zip(gathered[r][3], common_fp))
                              if a != b), len(common_fp)) for r in odd)
            lines.append(f"global batch content differs on rank(s) {odd} (first at sequence "
                         f"{first}): every rank must read the same global batch (same data "
                         "files, seed and sampler position)")
    return lines


# ---------------------------------------------------------------------- building shards
def _packed_inputs(task: Task, sequences: Sequence[torch.Tensor], weight_of: Callable,
                   targets: str = "next") -> tuple[torch.Tensor, ...]:
    """Packed ids, labels (next-token, or the ids themselves for ``targets="self"``) and per-token
    loss weights of a task (whole sequences), on the host: sharding indexes them with the
    layout's host tensors, without device syncs."""
    ids, labels, weights = [], [], []
    for s in task.seqs:
        seq = sequences[s].to(device="cpu", dtype=torch.long)
        ids.append(seq)
        w = torch.full((seq.shape[0],), weight_of(s), dtype=torch.float64)
        if targets == "self":
            labels.append(seq)
        else:
            labels.append(torch.cat([seq[1:], seq.new_full((1,), IGNORE_INDEX)]))
            w[-1] = 0.0
        weights.append(w)
    return torch.cat(ids), torch.cat(labels), torch.cat(weights)


def _shard_inputs(task: Task, layout: ShardLayout, sequences: Sequence[torch.Tensor],
                  weight_of: Callable, device: Optional[torch.device],
                  targets: str = "next") -> tuple[torch.Tensor, ...]:
    """This rank's shard of a task: host labels, then device ids, positions, labels, weights."""
    ids, labels, weights = _packed_inputs(task, sequences, weight_of, targets)
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


def target_weights(lengths: Sequence[int], loss_reduction: str = "token",
                   targets: str = "next") -> list[float]:
    """Loss weight of every target token of each sequence of a global batch (index = ``lengths``).

    ``token``: ``1 / T`` (T = targets of all the sequences); ``sequence``:
    ``1 / (S * targets of the sequence)`` (S = sequences with a target). A sequence has ``n - 1``
    next-token targets (one token: none), or ``n`` with ``targets="self"``. Shared by the
    executor and the engines' plain data-parallel baselines, so both optimise the same loss.
    """
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={loss_reduction!r}: must be one of {LOSS_REDUCTIONS}")
    if targets not in TARGET_KINDS:
        raise ValueError(f"targets={targets!r}: must be one of {TARGET_KINDS}")
    shift = 1 if targets == "next" else 0
    counts = [max(int(n) - shift, 0) for n in lengths]
    if loss_reduction == "token":
        total = sum(counts)
        return [1.0 / total if total else 0.0 for _ in counts]
    count = sum(1 for t in counts if t)
    return [1.0 / (count * t) if t else 0.0 for t in counts]


def _weighting(plan: Plan, loss_reduction: str, targets: str) -> Callable[[int], float]:
    """Loss weight of every target token of sequence ``s`` (over the sequences the plan runs)."""
    planned = sorted({s for t in plan.tasks for s in t.seqs})
    weights = target_weights([plan.lengths[s] for s in planned], loss_reduction, targets)
    return dict(zip(planned, weights)).__getitem__


def _weighted_loss(out: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                   loss_reduction: str, total: int) -> torch.Tensor:
    """Apply the loss weights to what ``forward_step`` returned (a sum or per-token losses)."""
    if out.dim() == 0:
        if loss_reduction != "token":
            raise ValueError(f"loss_reduction={loss_reduction!r} needs forward_step to return "
                             "per-token losses [T_local] (0 where labels == -100), not a sum")
        return out * (1.0 / total if total else 0.0)
    if out.shape != labels.shape:
        raise ValueError(f"forward_step returned shape {tuple(out.shape)}; expected a scalar "
                         f"(sum of token losses) or per-token losses {tuple(labels.shape)}")
    return (out * weights.to(out.dtype)).sum()


# ---------------------------------------------------------------------- timing
class _Clock:
    """Per-task forward/backward times without a host sync per task.

    On CUDA, events are recorded on the current stream and read once, after the step's last
    task (one synchronize per step); elsewhere ``perf_counter`` (CPU ops are synchronous).
    """

    def __init__(self, device: Optional[torch.device]) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Differences of consecutive marks of each task (3 marks per task), in seconds."""
        if self.cuda and self.marks:
            self.marks[-1].synchronize()
            gap = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            gap = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return gap


def _task_stats(done: list, gaps: list[float]) -> list[TaskStats]:
    """`TaskStats` of the tasks run, from the clock's gaps (forward, backward, between)."""
    return [TaskStats(task.id, task.degree, task.ulysses, task.ring, task.recompute_layers,
                      len(task.seqs), layout.num_packed, layout.num_tokens, gaps[3 * i],
                      gaps[3 * i + 1], task.duration)
            for i, (task, layout) in enumerate(done)]


# ---------------------------------------------------------------------- the executor
def run_plan(plan: Plan, sequences: Sequence[Optional[torch.Tensor]], rank: int,
             forward_step: ForwardStep, *, pool: GroupPool,
             backward: Optional[Callable[[torch.Tensor], Any]] = None,
             config: Any = None,
             loss_reduction: str = "token", max_position: Optional[int] = None,
             device: Optional[torch.device] = None, reduce_loss: bool = True,
             before_task: Optional[Callable[[Task], Any]] = None,
             targets: Optional[str] = None) -> StepStats:
    """Run DCP rank ``rank``'s tasks of ``plan`` (forward + backward); see the module docstring.

    ``config``: the DCP configuration in effect (a `DCPConfig`); the plan check compares it, and
    the content of ``sequences``, across the ranks.

    ``sequences``: the global batch (1-D token ids, host tensors preferred; entries no task of
    this rank uses may be ``None``). ``forward_step(input_ids, position_ids, labels)`` runs
    inside the task's context (pass `current_task()` on to the model, so a recompute on another
    thread sees it) and returns the summed token losses (labels -100 ignored) or per-token
    losses ``[T_local]`` (needed for ``loss_reduction="sequence"``). ``backward`` defaults to
    ``loss.backward()``; ``max_position`` is checked for every sequence before any task runs;
    ``device``: where shards go (default: the host); ``before_task(task)`` runs before each of
    this rank's tasks, outside its context (the step driver's empty lockstep slots);
    ``targets``: ``"next"`` (next-token labels) or ``"self"`` (every token its own target,
    see `SelfTargetBatch`); default: the batch's own kind (`batch_targets`).
    Collective over the DCP world of ``pool``, once per step on every rank. Gradients are not
    reduced here. Nothing in the task loop waits for the device (host-built shards,
    asynchronous copies, CUDA-event timings).
    """
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={loss_reduction!r}: must be one of {LOSS_REDUCTIONS}")
    targets = batch_targets(sequences, targets)
    t_start = time.perf_counter()
    device = torch.device(device) if device is not None else None
    comm_device = device if device is not None and device.type == "cuda" else None
    digest = check_plan(plan, pool, _local_problems(plan, sequences, rank, max_position),
                        comm_device, sequences=sequences, config=config)
    created = pool.ensure(plan)
    backward = backward or (lambda loss: loss.backward())
    weight_of = _weighting(plan, loss_reduction, targets)
    total = target_count(plan, targets)

    local_loss = torch.zeros((), dtype=torch.float64, device=device)
    local_tokens = 0
    clock = _Clock(device)
    done: list[tuple[Task, ShardLayout]] = []
    for task in plan.tasks_for_rank(rank):
        if before_task is not None:
            before_task(task)
        try:
            layout = ShardLayout.build([plan.lengths[s] for s in task.seqs], task.ulysses,
                                       task.ring, task.ranks.index(rank))
            labels_host, ids_l, pos_l, labels_l, weights_l = _shard_inputs(
                task, layout, sequences, weight_of, device, targets)
            ctx = pool.context_for(task, rank, layout)
            with task_context(ctx):
                clock.mark()
                out = forward_step(ids_l, pos_l, labels_l)
                loss = _weighted_loss(out, labels_l, weights_l, loss_reduction, total)
                clock.mark()
                backward(loss)
                clock.mark()
        except Exception as exc:  # noqa: BLE001 - re-raised with rank / task / sequences
            raise TaskError(rank, task, plan.lengths, exc) from exc
        local_loss = local_loss + loss.detach().to(torch.float64)
        local_tokens += int((labels_host != IGNORE_INDEX).sum())
        done.append((task, layout))

    stats = _task_stats(done, clock.seconds())
    global_loss = global_sum(float(local_loss), pool.world_group, comm_device) \
        if reduce_loss else float(local_loss)
    return StepStats(loss=global_loss, tokens=total, local_loss=float(local_loss),
                     local_tokens=local_tokens, tasks=stats, wall_s=time.perf_counter() - t_start,
                     digest=digest, groups_created=created)


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
