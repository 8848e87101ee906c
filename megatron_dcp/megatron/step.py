"""`DCPForwardBackward`: Megatron's ``forward_backward_func`` that runs one DCP plan per call.

    forward_backward = DCPForwardBackward(dcp_config, model_shape=shape)
    losses_reduced = forward_backward(forward_step_func=forward_step, data_iterator=it,
                                      model=[model], num_microbatches=1, seq_length=0,
                                      micro_batch_size=1)
    result = losses_reduced.result  # the step's StepResult: loss, plan, timings

``data_iterator`` yields one global batch per call; the step is the engine-neutral
`megatron_dcp.runtime.step.StepDriver` and `MegatronStepEngine` is Megatron's side of it
(micro-batches that carry the task and its recomputed layers as ``packed_seq_params``, DDP's
``no_sync``, one ``finalize_model_grads``). Nothing of Megatron is patched: the layers of
`get_gpt_layer_dcp_spec` read the task from their call.

The groups are Megatron's: ``pg_collection`` when the caller passes one (tp, pp, dp or dp_cp),
else ``parallel_state`` (`MegatronParallel`). The model's ``TransformerConfig`` is left alone,
except during a pipeline schedule call: Megatron's schedules read their settings from the model's
config and take no other, so for that call `schedule_settings` sets five fields (six when
interleaved) and restores them after (which, and why, is listed there). What differs from
Megatron's schedules, and why: docs/MEGATRON.md.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megatron_dcp.config import IGNORE_INDEX, DCPConfig
from megatron_dcp.plan.pipeline import interleaved_micro_batches
from megatron_dcp.plan.plan import Plan
from megatron_dcp.runtime.groups import GroupPool
from megatron_dcp.runtime.executor import MicroStep, PlanWork
from megatron_dcp.runtime.step import Shard, StepDriver, StepEngine, StepResult


class StepReports(list):
    """What one call of `DCPForwardBackward` returns: Megatron's loss reports (a list of dicts,
    as Megatron's schedules return), and ``result``, the step's `StepResult` (loss, plan,
    timings, this rank's `StepStats`)."""

    def __init__(self, reports: list[dict], result: StepResult) -> None:
        super().__init__(reports)
        self.result = result


@dataclass
class GlobalBatch:
    """The sequences of one optimizer step (index = plan sequence index) and optionally its plan;
    ``next_lengths``: the lengths of the next step's batch, planned on a background thread while
    this step runs (``DCPConfig.plan_ahead``)."""

    sequences: Sequence[torch.Tensor]
    plan: Optional[Plan] = None
    next_lengths: Optional[Sequence[int]] = None


@dataclass(frozen=True)
class MegatronParallel:
    """Megatron's parallel layout as a DCP step sees it: the groups of ``pg_collection`` when
    given (a `megatron.core.process_groups_config.ProcessGroupCollection`), else
    ``parallel_state``'s; sizes 1 where Megatron's model parallelism is not set up. The one
    place this package reads Megatron's tensor-, pipeline- and data-parallel layout."""

    tensor: int = 1
    pipeline: int = 1
    virtual: int = 1
    """Virtual pipeline stages per pipeline rank (1 without interleaving)."""
    pg_collection: object = None
    """The caller's collection, passed on to Megatron's schedule (``None``: built from
    ``parallel_state`` there)."""

    @classmethod
    def of(cls, pg_collection=None) -> "MegatronParallel":
        try:
            from megatron.core import parallel_state
        except ImportError:
            return cls(pg_collection=pg_collection)
        virtual = int(parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1)
        if pg_collection is not None:
            return cls(pg_collection.tp.size(), pg_collection.pp.size(), virtual, pg_collection)
        if not parallel_state.model_parallel_is_initialized():
            return cls(virtual=virtual)
        return cls(int(parallel_state.get_tensor_model_parallel_world_size()),
                   int(parallel_state.get_pipeline_model_parallel_world_size()), virtual)

    @property
    def pipeline_group(self):
        """This rank's pipeline-parallel group."""
        if self.pg_collection is not None:
            return self.pg_collection.pp
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_group()

    @property
    def data_group(self):
        """This rank's data-parallel group (the DCP world; Megatron's CP size is 1 under DCP,
        so ``dp_cp`` is the same ranks)."""
        if self.pg_collection is not None:
            groups = vars(self.pg_collection)  # a collection holds only the groups it was given
            return groups["dp"] if "dp" in groups else groups["dp_cp"]
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def model_chunks(self, model) -> list:
        """The model as a list of chunks: one, or one per virtual pipeline stage."""
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != self.virtual:
            raise ValueError(f"expected {self.virtual} model chunk(s) (the virtual pipeline "
                             f"size), got {len(chunks)}")
        return chunks


def _token_losses(output_tensor, loss_mask, shard: Shard) -> torch.Tensor:
    """Masked per-token losses of the shard's own tokens (any SP padding dropped)."""
    return (output_tensor.reshape(-1).float() * loss_mask.view(-1))[:shard.labels.numel()]


class MegatronStepEngine(StepEngine):
    """Megatron's `StepEngine` for one call of `DCPForwardBackward`; ``chunks``: the model
    (with virtual pipeline stages: one chunk per stage); ``parallel``: Megatron's layout."""

    def __init__(self, chunks: list, forward_step_func: Callable, forward_only: bool,
                 parallel: MegatronParallel, p2p_communicator=None) -> None:
        from megatron.core.utils import get_model_config

        self.parallel, self.p2p_communicator = parallel, p2p_communicator
        self.chunks = chunks
        self.model = chunks[0]
        self.mconfig = get_model_config(self.model)
        self.forward_step_func = forward_step_func
        self.forward_only = forward_only
        self.reports: list[dict] = []
        self.nonfinite_ranks: dict[int, None] = {}
        """Global ranks whose own gradients were not finite in the last `finish`."""

    def forward_loss(self, shard: Shard, per_token: bool) -> torch.Tensor:
        """Megatron's ``forward_step_func`` and ``loss_func`` on one shard; the task (and its
        recomputed layers) travels in the micro-batch's ``packed_seq_params``."""
        output_tensor, loss_func, loss_mask = self._forward(shard)
        loss_sum, _num_tokens, _report = self._loss(loss_func, output_tensor)
        if per_token:  # the driver weights every token by its sequence's 1/(S * targets)
            return _token_losses(output_tensor, loss_mask, shard)
        return loss_sum

    def _forward(self, shard: Shard, model=None):
        """``forward_step_func`` on the shard's micro-batch through ``model`` (default: the one
        chunk): (output, loss_func, loss mask).
        Under sequence parallelism the micro-batch is padded at its end to a multiple of the TP
        size (padding: token 0, position 0, loss mask 0; attention skips it)."""
        from megatron_dcp.megatron.spec import DCPTaskParams

        tp = self.parallel.tensor if self.mconfig.sequence_parallel else 1
        pad = -shard.labels.numel() % tp

        def pad_end(x, value=0):
            return torch.nn.functional.pad(x, (0, pad), value=value).view(1, -1)

        params = DCPTaskParams.of(shard.task, train=not self.forward_only, sp_pad=pad)
        loss_mask = pad_end((shard.labels != IGNORE_INDEX).to(torch.float32))
        micro_batch = {
            "tokens": pad_end(shard.input_ids),
            "labels": pad_end(shard.labels.clamp(min=0)),
            "loss_mask": loss_mask,
            "position_ids": pad_end(shard.position_ids),
            "attention_mask": None,
            "packed_seq_params": params,
        }
        output_tensor, loss_func = self.forward_step_func(iter([micro_batch]),
                                                          model or self.model)
        if params is not None and not params.reached:
            raise ValueError(
                f"task {shard.task.task.id}: no DCP layer ran with the micro-batch's "
                "packed_seq_params; the forward_step_func must pass "
                "packed_seq_params=micro_batch['packed_seq_params'] to the model (else the shard "
                "runs as one ordinary sequence: wrong attention and positions)")
        return output_tensor, loss_func, loss_mask

    def _loss(self, loss_func, output_tensor):
        """``loss_func`` in its per-token form (loss_sum, num_tokens, report); keeps the report."""
        outputs = loss_func(output_tensor)
        if len(outputs) != 3:
            raise ValueError("DCP needs the per-token loss_func form (loss_sum, num_tokens, "
                             "report); got a 2-tuple (mean loss)")
        self.reports.append(outputs[2])
        return outputs

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        if self.mconfig.grad_scale_func is not None:
            loss = self.mconfig.grad_scale_func(loss)
        loss.backward()

    def reduction_scope(self):
        stack = ExitStack()
        for chunk in self.chunks:
            if hasattr(chunk, "no_sync"):
                stack.enter_context(chunk.no_sync())
        return stack

    def finish(self) -> Optional[float]:
        """Finalise gradients once (Megatron DDP), or SUM-reduce them (a bare module); the
        optimizer step is the caller's. Before that, one all-reduce over the job finds the ranks
        whose own gradients are not finite (`nonfinite_gradient_ranks`: ``nonfinite_ranks``);
        then the gradient norm is ``nan`` on every rank (`StepDriver` stops or skips the step
        before the update), else ``None`` (not computed: Megatron's optimizer does)."""
        import torch.distributed as dist

        from megatron_dcp.runtime.nonfinite import nonfinite_gradient_ranks

        grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None
                 else p.grad for c in self.chunks for p in c.parameters() if p.requires_grad]
        device = grads[0].device if grads and grads[0] is not None \
            and grads[0].device.type == "cuda" else None
        self.nonfinite_ranks = nonfinite_gradient_ranks(grads, dist.get_rank(),
                                                        dist.get_world_size(), None, device)
        self._reduce()
        return float("nan") if self.nonfinite_ranks else None

    def update_applied(self) -> bool:
        """False: ``finish`` applies no update (the caller steps the optimizer, and skips it on
        ``StepResult.skipped``)."""
        return False

    def _reduce(self) -> None:
        """Megatron's ``finalize_model_grads`` (its DDP), or a SUM over data parallel."""
        finalize = self.mconfig.finalize_model_grads_func
        if finalize is None:
            from megatron.core.distributed import finalize_model_grads as finalize
        if hasattr(self.model, "finish_grad_sync"):
            finalize(self.chunks, None, pg_collection=self.parallel.pg_collection) \
                if self.parallel.pg_collection is not None else finalize(self.chunks, None)
        else:
            from megatron_dcp.runtime.executor import reduce_gradients

            reduce_gradients([p for c in self.chunks for p in c.parameters() if p.requires_grad],
                             self.parallel.data_group)


@contextmanager
def schedule_settings(mconfig, interleaved: bool, timers=None):
    """The ``TransformerConfig`` fields Megatron's pipeline schedule reads, set for one DCP
    schedule call and restored after it (also when it fails). Megatron's schedules take these
    from the model's config only, so there is no other way to pass them:

    * ``variable_seq_lengths=True``: shapes sent ahead of every activation (each slot has its
      own length);
    * ``no_sync_func``, ``grad_sync_func``, ``finalize_model_grads_func`` = ``None``: no
      gradient sync switched on inside the schedule and no finalisation at its end (DCP
      finalises once, in ``finish``, with its own 1/T weighting instead of Megatron's
      1/tokens; ``finish`` reads the caller's ``finalize_model_grads_func`` again, restored);
    * interleaved: ``batch_p2p_comm=False``: P2P without ``batch_isend_irecv``
      (`pipeline_communication`);
    * ``timers``: `SlotTimers`, which time every micro-batch for the calibration and pass every
      call on to the caller's timers."""
    settings = dict(_SCHEDULE_SETTINGS, **({"batch_p2p_comm": False} if interleaved else {}),
                    **({"timers": timers} if timers is not None else {}))
    saved = {name: getattr(mconfig, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(mconfig, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(mconfig, name, value)


_SCHEDULE_SETTINGS = {"variable_seq_lengths": True, "no_sync_func": None, "grad_sync_func": None,
                      "finalize_model_grads_func": None}


class SlotTimers:
    """Megatron's ``config.timers`` during one DCP schedule call: times the ``forward-compute``
    (forward and loss) and ``backward-compute`` of every micro-batch on this stage, for the
    calibration, and passes every call on to the timers it stands in for (``inner``: Megatron-LM's,
    or ``None``). As the free path's task clock (`megatron_dcp.runtime.executor`): CUDA events on
    the current stream, read once after the schedule (one synchronize), else ``perf_counter``.

    The micro-batch of a forward is the one its ``forward_step_func`` takes (`forward`); a stage
    runs the backwards in the order of its forwards (1F1B; interleaved, Megatron's schedule table
    with the chunks reversed), so the i-th backward is the i-th forward's micro-batch.
    """

    _NAMES = ("forward-compute", "backward-compute")

    def __init__(self, inner=None, cuda: bool = False) -> None:
        self.inner, self.cuda = inner, cuda
        self.forwards: list = []
        """The micro-batch of each forward, in order."""
        self.marks: dict[str, list] = {name: [] for name in self._NAMES}

    def forward(self, step) -> None:
        """The forward now running is ``step``'s (called from the ``forward_step_func``)."""
        self.forwards.append(step)

    def __call__(self, name: str, log_level=None):
        inner = None
        if self.inner is not None:
            inner = self.inner(name) if log_level is None else self.inner(name, log_level)
        return _SlotTimer(self, name, inner)

    def _mark(self, name: str) -> None:
        if name not in self.marks:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name].append(event)
        else:
            self.marks[name].append(time.perf_counter())

    def seconds(self) -> list[tuple[object, float, float]]:
        """``(micro-batch, forward seconds, backward seconds)`` of every micro-batch this stage
        ran, its model chunks summed (backward 0 when forward only); ``[]`` when the marks do not
        pair up with the forwards (a schedule that calls the timers otherwise)."""
        spans = {}
        for name, marks in self.marks.items():
            if self.cuda and marks:
                marks[-1].synchronize()
                spans[name] = [a.elapsed_time(b) / 1e3 for a, b in zip(marks[::2], marks[1::2])]
            else:
                spans[name] = [b - a for a, b in zip(marks[::2], marks[1::2])]
        forward, backward = spans["forward-compute"], spans["backward-compute"]
        n = len(self.forwards)
        if any(len(m) % 2 for m in self.marks.values()) or len(forward) != n \
                or len(backward) not in (0, n):
            return []
        totals: dict[int, list] = {}
        for i, step in enumerate(self.forwards):
            entry = totals.setdefault(id(step), [step, 0.0, 0.0])
            entry[1] += forward[i]
            entry[2] += backward[i] if backward else 0.0
        return [tuple(entry) for entry in totals.values()]


class _SlotTimer:
    """One of `SlotTimers`' timers: marks its start and stop, and calls the inner timer's."""

    def __init__(self, timers: SlotTimers, name: str, inner) -> None:
        self.timers, self.name, self.inner = timers, name, inner

    def start(self, *args, **kwargs) -> None:
        if self.inner is not None:
            self.inner.start(*args, **kwargs)
        self.timers._mark(self.name)

    def stop(self, *args, **kwargs) -> None:
        self.timers._mark(self.name)
        if self.inner is not None:
            self.inner.stop(*args, **kwargs)


def pipeline_communication(mconfig, parallel: Optional[MegatronParallel] = None,
                           p2p_communicator=None) -> dict:
    """``p2p_communicator`` and ``pg_collection`` for Megatron's pipeline schedules with micro-
    batches of different lengths (``variable_seq_lengths``), correct with two stages interleaved.

    There the previous and the next stage are the same rank, and a call can send to it in both
    directions (the activation of one chunk, the gradient of another). Messages between two ranks
    match in the order they are posted: megatron-core 0.16's shape exchange posts the backward
    send before the forward one but receives the forward one first, so the shapes cross. Here the
    shapes go forward first, then backward (the receives in the same order); the tensors
    themselves go without ``batch_isend_irecv`` (`schedule_settings`), whose per-rank path
    sends each direction over its own group with two stages.

    ``parallel.pg_collection`` is passed on when the caller gave one; ``p2p_communicator``: the
    caller's, whose pipeline group the communicator here uses (with its own shape exchange).
    ``parallel`` defaults to ``parallel_state``'s layout."""
    parallel = parallel if parallel is not None else MegatronParallel.of()
    groups = parallel.pg_collection
    if groups is None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = ProcessGroupCollection.use_mpu_process_groups(
            ["tp", "cp", "embd", "pos_embd", "pp", "dp_cp"])
    pp_group = p2p_communicator.pp_group if p2p_communicator is not None \
        else parallel.pipeline_group
    return {"p2p_communicator": _ordered_shapes_communicator()(pp_group, mconfig),
            "pg_collection": groups}


@functools.cache
def _ordered_shapes_communicator():
    """Megatron's ``P2PCommunicator`` with the shape exchange of `pipeline_communication` (the
    class is made once, on first use: megatron-core is imported only then)."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    class OrderedShapes(P2PCommunicator):
        def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            shapes = [None, None]  # received from the previous rank, from the next
            ops = []
            for i, send, recv, to, source in (  # forward, then backward
                    (0, tensor_send_next, recv_prev, self.next_rank, self.prev_rank),
                    (1, tensor_send_prev, recv_next, self.prev_rank, self.next_rank)):
                if send is not None:
                    shape = torch.tensor(send.size(), device=device, dtype=torch.int64)
                    ops.append(dist.P2POp(dist.isend, shape, to, self.pp_group))
                if recv:
                    shapes[i] = torch.empty(3, device=device, dtype=torch.int64)
                    ops.append(dist.P2POp(dist.irecv, shapes[i], source, self.pp_group))
            for req in dist.batch_isend_irecv(ops) if ops else []:
                req.wait()
            return tuple(s.tolist() if s is not None else [0, 0, 0] for s in shapes)

    return OrderedShapes


class MegatronPipelineEngine(MegatronStepEngine):
    """`MegatronStepEngine` for pipeline parallelism: the slots of a lockstep plan are the
    micro-batches of Megatron's own schedule (``get_forward_backward_func()``: 1F1B, or the
    interleaved schedule over the model chunks of a virtual pipeline, where every chunk reads the
    micro-batches in order and the last stage's last chunk computes the loss; its count is
    padded with empty micro-batches to one the schedule accepts, `interleaved_micro_batches`).

    Every stage runs the same plan, so slot k is micro-batch k on every pipeline, and the ranks of
    a task meet in its collectives inside that micro-batch's forward and backward on each stage
    (the schedule runs the same order on every pipeline). A slot where this rank has no task is
    an empty micro-batch (two tokens, loss weight 0). The loss is weighted on the last stage
    (``work.loss``) and broadcast over the pipeline, so every stage reports its pipeline's share.
    """

    def run_micro_steps(self, work: PlanWork, per_token: bool, train: bool) -> None:
        """All of this rank's micro-steps in one schedule call, each reported once after it
        (``work.record``: its weighted loss on the last stage, its seconds on this stage)."""
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_dcp.megatron.cpu import CudaAsCpu, cpu_enabled

        if not work.plan.lockstep:
            raise ValueError("DCP with pipeline parallelism runs a lockstep plan (every pipeline "
                             "the same slots): plan with ModelShape(pipeline_parallel=P) or "
                             "DCPConfig(schedule='lockstep')")
        steps = list(work)
        interleaved = len(self.chunks) > 1
        if interleaved:  # the schedule's count; the rest are empty micro-steps
            count = interleaved_micro_batches(len(steps), self.parallel.pipeline,
                                              self.mconfig.microbatch_group_size_per_vp_stage,
                                              virtual=len(self.chunks))
            steps += [work.empty_step() for _ in range(count - len(steps))]
        call = _ScheduleCall(self, work, per_token,
                             SlotTimers(self.mconfig.timers, cuda=work.comm_device is not None))
        # interleaved: one iterator per chunk, each over every micro-batch
        data = [iter(steps) for _ in self.chunks] if interleaved else iter(steps)
        with schedule_settings(self.mconfig, interleaved, call.timers), \
                CudaAsCpu() if cpu_enabled() else nullcontext():
            get_forward_backward_func(self.parallel.pipeline, len(self.chunks) if interleaved
                                      else None)(
                forward_step_func=call.forward_step, data_iterator=data, model=self.chunks,
                num_microbatches=len(steps), seq_length=1, micro_batch_size=1,
                forward_only=not train,
                **pipeline_communication(self.mconfig, self.parallel, self.p2p_communicator))
        times = {id(step): (f, b) for step, f, b in call.timers.seconds()}  # this stage's
        for step in steps:
            work.record(step, call.losses.get(id(step)), *times.get(id(step), (None, None)))
        # the loss exists on the last stage only: every stage reports its pipeline's
        group = self.parallel.pipeline_group
        dist.broadcast(work.local_loss, src=dist.get_process_group_ranks(group)[-1], group=group)


class _ScheduleCall:
    """The ``forward_step_func`` of one pipeline schedule call and what it saw: the weighted
    loss of every micro-step whose loss this stage computed (``losses``, by micro-step), and
    the micro-batches' times (``timers``)."""

    def __init__(self, engine: MegatronPipelineEngine, work: PlanWork, per_token: bool,
                 timers: SlotTimers) -> None:
        self.engine, self.work, self.per_token, self.timers = engine, work, per_token, timers
        self.losses: dict[int, torch.Tensor] = {}

    def forward_step(self, data_iterator, model):
        """Megatron's ``forward_step_func``: the next micro-step's forward through ``model``
        (one chunk), and its loss function."""
        step = next(data_iterator)
        self.timers.forward(step)
        output, loss_func, loss_mask = self.engine._forward(step.shard, model)
        return output, functools.partial(self._loss, step, loss_func, loss_mask)

    def _loss(self, step: MicroStep, loss_func, loss_mask, output_tensor):
        """The loss function the schedule calls on the last stage: the micro-step's weighted
        loss (``work.loss``), with Megatron's token count and report."""
        loss_sum, num_tokens, report = self.engine._loss(loss_func, output_tensor)
        out = _token_losses(output_tensor, loss_mask, step.shard) if self.per_token else loss_sum
        loss = self.work.loss(step, out)
        self.losses[id(step)] = loss.detach()
        return loss, num_tokens, report


class DCPForwardBackward:
    """Megatron ``forward_backward_func`` replacement that executes one DCP plan per call.

    ``config``: the DCP settings (planner policy ...); ``model_shape``: `ModelShape` for the
    planner (needed unless every `GlobalBatch` carries its plan); ``pool``: a
    `megatron_dcp.runtime.groups.GroupPool` over the data-parallel ranks (built on first use);
    ``zero_stage``: 1 with Megatron's distributed optimizer, else 0 (the planner's memory model).
    ``vocabulary_lengths``: the sequence lengths the job will see, the same on every rank (the
    indexed dataset's document sizes cut at the longest sequence, e.g.
    `GlobalBatchSampler.distinct_lengths`, or a sample of batches): the groups created at the
    first use are only those they need (`megatron_dcp.plan.planners.vocabulary_for_lengths`)
    and every plan is made over them (a batch that would want a missing group gets the best
    plan within them); ``None``: the default vocabulary.
    """

    def __init__(self, config: DCPConfig, *, model_shape=None, pool=None, hardware=None,
                 zero_stage: int = 0, vocabulary_lengths: Optional[Sequence[int]] = None) -> None:
        self.config = config
        self.vocabulary_lengths = vocabulary_lengths
        # Memory the planner counts per rank for optimizer states: 0 = every rank holds them all
        # (Megatron's default), 1 = sharded over the data-parallel ranks
        # (--use-distributed-optimizer).
        self.zero_stage = zero_stage
        self.model_shape = model_shape
        self.pool = pool
        self.hardware = hardware
        self._driver: Optional[StepDriver] = None
        self._parallel: Optional[MegatronParallel] = None  # the last call's (its pg_collection)
        self._checked: set[int] = set()  # ids of the models checked (once, at their first step)
        self._report_keys: tuple[str, ...] = ("lm loss",)

    @property
    def driver(self) -> StepDriver:
        """The step driver over the data-parallel ranks (built on first use: collective)."""
        if self._driver is None:
            import torch.distributed as dist

            if self.pool is None:
                dp_group = self._layout().data_group
                self.pool = GroupPool(world_ranks=dist.get_process_group_ranks(dp_group))
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else None
            self._driver = StepDriver(self.config.replace(enabled=True), pool=self.pool,
                                      model_shape=self.planning_shape(), hardware=self.hardware,
                                      zero_stage=self.zero_stage, device=device)
            if self.model_shape is not None:  # every communicator now, none inside a step
                report = self._driver.create_groups(self.vocabulary_lengths)
                if dist.get_rank() == 0:
                    print(f"[megatron-dcp] {report}", flush=True)
        return self._driver

    @property
    def iteration(self) -> int:
        """Training steps taken (the planner's ``iteration``)."""
        return self._driver.iteration if self._driver is not None else 0

    def plan_for(self, lengths: Sequence[int], world_size: Optional[int] = None) -> Plan:
        """The plan of one global batch (deterministic: the same on every rank)."""
        if world_size is None:
            return self.driver.plan(lengths)
        planner = StepDriver(self.config.replace(enabled=True), pool=None,
                             model_shape=self.planning_shape(), hardware=self.hardware,
                             zero_stage=self.zero_stage)  # plans only: no groups
        return planner.plan(lengths, self.iteration, world_size)

    def planning_shape(self):
        """The `ModelShape` the planner sees: the given one, with Megatron's tensor- and
        pipeline-parallel sizes filled in where the shape leaves them at 1 (memory and time are
        those of one TP rank; P > 1 plans lockstep slots for the pipeline)."""
        shape, parallel = self.model_shape, self._layout()
        if shape is not None and shape.tensor_parallel == 1 and parallel.tensor > 1:
            shape = dataclasses.replace(shape, tensor_parallel=parallel.tensor)
        if shape is not None and shape.pipeline_parallel == 1 and parallel.pipeline > 1:
            shape = dataclasses.replace(shape, pipeline_parallel=parallel.pipeline)
        return shape

    def _layout(self) -> MegatronParallel:
        """Megatron's layout: the last call's (with its ``pg_collection``), else
        ``parallel_state``'s."""
        return self._parallel if self._parallel is not None else MegatronParallel.of()

    def __call__(self, *, forward_step_func: Callable, data_iterator, model,
                 num_microbatches: Optional[int] = None, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, decoder_seq_length=None,
                 forward_only: bool = False, collect_non_loss_data: bool = False,
                 first_val_step=None, adjust_tensor_shapes_fn=None, p2p_communicator=None,
                 pg_collection=None, force_all_reduce: bool = False) -> StepReports:
        """Run this rank's tasks of the next global batch; returns the loss reports and the
        `StepResult` (`StepReports`). Takes every keyword Megatron-LM's ``train_step`` passes
        (0.19.2 adds ``force_all_reduce``, for its gradient logging: not used here).
        ``pg_collection``: Megatron's groups (tp, pp, dp or dp_cp; default ``parallel_state``'s),
        used for sizes, the reduction and the pipeline schedule; ``p2p_communicator``: its
        pipeline group is the schedule's (`pipeline_communication`)."""
        if collect_non_loss_data:
            raise ValueError("DCPForwardBackward: collect_non_loss_data is not supported")
        self._parallel = parallel = MegatronParallel.of(pg_collection)
        chunks = parallel.model_chunks(model)
        for chunk in chunks:
            self._check(chunk, forward_only)
        kind = MegatronPipelineEngine if parallel.pipeline > 1 else MegatronStepEngine
        engine = kind(chunks, forward_step_func, forward_only, parallel, p2p_communicator)
        batch = next(data_iterator)
        if not isinstance(batch, GlobalBatch):
            batch = GlobalBatch(sequences=list(batch))
        driver = self.driver
        if batch.plan is not None and batch.plan.world_size != driver.world_size:
            raise ValueError(f"plan for a DCP world of {batch.plan.world_size} ranks, but the "
                             f"data-parallel size is {driver.world_size}")
        result = driver.step(engine, list(batch.sequences), batch.plan, train=not forward_only,
                             next_lengths=batch.next_lengths)
        reports = engine.reports
        if reports:
            self._report_keys = tuple(reports[0])
        else:  # a rank without tasks reports zero tokens (Megatron sums the reports)
            device = driver.device
            reports.append({k: torch.zeros(2, device=device) for k in self._report_keys})
        return StepReports(reports, result)

    def close(self) -> None:
        """Join the driver's planning thread (call once training ends)."""
        if self._driver is not None:
            self._driver.close()

    def _check(self, model, forward_only: bool) -> None:
        """Settings DCP cannot run, refused before any collective."""
        from megatron.core.utils import get_model_config

        if getattr(getattr(model, "ddp_config", None), "overlap_param_gather", False):
            from megatron_dcp.megatron.args import OVERLAP_PARAM_GATHER_PROBLEM

            raise ValueError(OVERLAP_PARAM_GATHER_PROBLEM.replace(
                "--overlap-param-gather", "DistributedDataParallelConfig.overlap_param_gather"))
        mconfig = get_model_config(model)
        if not forward_only and not mconfig.calculate_per_token_loss:
            raise ValueError("DCP needs calculate_per_token_loss=True in the model's "
                             "TransformerConfig (Megatron's DDP must SUM gradients over "
                             "data-parallel ranks; DCP applies 1/T itself)")
        if id(model) in self._checked:
            return
        if mconfig.recompute_granularity == "full":
            raise ValueError("DCP recomputes the first task.recompute_layers layers of each task "
                             "itself (DCPTransformerLayer); with recompute_granularity='full' in "
                             "the TransformerConfig Megatron's block would recompute its own "
                             "layers on top: build the config with recompute_granularity=None")
        from megatron_dcp.megatron.spec import check_model

        check_model(model)
        self._checked.add(id(model))
