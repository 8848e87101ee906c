"""`MegatronPipelineEngine`: DCP micro-steps through Megatron's own pipeline schedule (1F1B, or
interleaved over the model chunks of a virtual pipeline), one schedule call per step.

Megatron's schedules read their settings from the model's ``TransformerConfig`` and take no
other, so for that call `schedule_settings` sets five fields (six when interleaved) and restores
them after; `SlotTimers` times every micro-batch for the calibration through ``config.timers``;
`pipeline_communication` gives the schedule a ``p2p_communicator`` whose shape exchange is
correct with two stages interleaved. What differs from Megatron's schedules, and why:
docs/MEGATRON.md.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Optional

import torch

from megatron_dcp.megatron.engine import MegatronStepEngine, token_losses
from megatron_dcp.megatron.overlap import param_gathers
from megatron_dcp.megatron.parallel import MegatronParallel
from megatron_dcp.plan.pipeline import interleaved_micro_batches
from megatron_dcp.runtime.executor import Clock, MicroStep, PlanWork
from megatron_dcp.runtime.overlap import shape_key


@contextmanager
def schedule_settings(mconfig, interleaved: bool, timers=None, reduction=None):
    """The ``TransformerConfig`` fields Megatron's pipeline schedule reads, set for one DCP
    schedule call and restored after it (also when it fails). Megatron's schedules take these
    from the model's config only, so there is no other way to pass them:

    * ``variable_seq_lengths=True``: shapes sent ahead of every activation (each slot has its
      own length);
    * ``no_sync_func``, ``grad_sync_func``, ``finalize_model_grads_func`` = ``None``: no
      gradient sync switched on inside the schedule and no finalisation at its end (DCP
      finalises once, in ``finish``, with its own 1/T weighting instead of Megatron's
      1/tokens; ``finish`` reads the caller's ``finalize_model_grads_func`` again, restored);
      with DDP's ``overlap_grad_reduce`` (``reduction``, an `OrderedReduction`) the
      ``no_sync_func`` is `_sync_windows`: where the schedule switches gradient sync on (each
      model chunk's last backward) the overlapped reduction counts and starts buckets, the
      DDP itself staying in ``no_sync`` (`megatron_dcp.megatron.overlap`);
    * interleaved: ``batch_p2p_comm=False``: P2P without ``batch_isend_irecv``
      (`pipeline_communication`);
    * ``timers``: `SlotTimers`, which time every micro-batch for the calibration and pass every
      call on to the caller's timers."""
    settings = dict(_SCHEDULE_SETTINGS, **({"batch_p2p_comm": False} if interleaved else {}),
                    **({"timers": timers} if timers is not None else {}),
                    **({"no_sync_func": functools.partial(_sync_windows, reduction)}
                       if reduction is not None else {}))
    saved = {name: getattr(mconfig, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(mconfig, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(mconfig, name, value)


@contextmanager
def _sync_windows(reduction):
    """The schedule's ``no_sync_func`` with an overlapped reduction: gradient sync off (the
    schedule enters it) disarms the reduction, sync on (it exits, before a model chunk's last
    backward) arms it."""
    reduction.disarm()
    try:
        yield
    finally:
        reduction.arm()


_SCHEDULE_SETTINGS = {"variable_seq_lengths": True, "no_sync_func": None, "grad_sync_func": None,
                      "finalize_model_grads_func": None}


class SlotTimers:
    """Megatron's ``config.timers`` during one DCP schedule call: times the ``forward-compute``
    (forward and loss) and ``backward-compute`` of every micro-batch on this stage, for the
    calibration, and passes every call on to the timers it stands in for (``inner``: Megatron-LM's,
    or ``None``). One `Clock` per timer name (CUDA events read once after the schedule, else
    ``perf_counter``), as `PlanWork` times its tasks.

    The micro-batch of a forward is the one its ``forward_step_func`` takes (`forward`); a stage
    runs the backwards in the order of its forwards (1F1B; interleaved, Megatron's schedule table
    with the chunks reversed), so the i-th backward is the i-th forward's micro-batch.
    """

    _NAMES = ("forward-compute", "backward-compute")

    def __init__(self, inner=None, cuda: bool = False) -> None:
        self.inner = inner
        self.forwards: list = []
        """The micro-batch of each forward, in order."""
        self.clocks = {name: Clock(cuda) for name in self._NAMES}

    def forward(self, step) -> None:
        """The forward now running is ``step``'s (called from the ``forward_step_func``)."""
        self.forwards.append(step)

    def __call__(self, name: str, log_level=None):
        inner = None
        if self.inner is not None:
            inner = self.inner(name) if log_level is None else self.inner(name, log_level)
        return _SlotTimer(self, name, inner)

    def _mark(self, name: str) -> None:
        if name in self.clocks:
            self.clocks[name].mark()

    def seconds(self) -> list[tuple[object, float, float]]:
        """``(micro-batch, forward seconds, backward seconds)`` of every micro-batch this stage
        ran, its model chunks summed (backward 0 when forward only); ``[]`` when the marks do not
        pair up with the forwards (a schedule that calls the timers otherwise)."""
        # a timer's marks are start, stop, start, ...: every other gap is a micro-batch's
        forward, backward = (self.clocks[name].seconds()[::2] for name in self._NAMES)
        n = len(self.forwards)
        if any(len(c.marks) % 2 for c in self.clocks.values()) or len(forward) != n \
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


class SlotShapes:
    """The shapes a 1F1B schedule receives, known on every stage without asking: micro-batch k
    has the same tokens on every stage (every stage runs the same lockstep plan), so the
    activation from the previous stage for the k-th forward and the gradient from the next for
    the k-th backward are both ``[tokens_k / sp_tp, 1, hidden]`` (forwards and backwards each
    run in micro-batch order). Megatron's exchange of them cost a P2P and a host read
    (``tolist``) per received tensor: 70 a step on a middle stage of a 4-stage dry run."""

    def __init__(self, steps: list, hidden: int, sp_tp: int) -> None:
        shapes = [[(n + -n % sp_tp) // sp_tp, 1, hidden]
                  for n in (step.shard.labels.numel() for step in steps)]
        self.order = {"forward": shapes, "backward": shapes}
        """The shapes received, in the order each direction receives them."""
        self.taken = {"forward": 0, "backward": 0}

    @classmethod
    def interleaved(cls, steps: list, hidden: int, sp_tp: int, *, chunks: int, stage: int,
                    stages: int, group: int) -> "SlotShapes":
        """The shapes Megatron's interleaved schedule receives on pipeline rank ``stage``:
        virtual micro-batch ``v`` is micro-batch ``m`` of chunk ``c`` by Megatron's schedule
        table (``group``: ``microbatch_group_size_per_vp_stage``; backward runs chunks in
        reverse); each direction receives once per virtual micro-batch, in that order, except
        where nothing comes: the first stage's first chunk forward, the last stage's last chunk
        backward. Shapes depend on ``m`` only (every chunk runs micro-batch ``m``'s tokens)."""
        from megatron.core.pipeline_parallel.schedules import get_schedule_table

        out = cls(steps, hidden, sp_tp)
        shapes = out.order["forward"]
        table = get_schedule_table(len(steps), chunks, group)
        out.order = {
            "forward": [shapes[m] for m, c in table if not (stage == 0 and c == 0)],
            "backward": [shapes[m] for m, c in table  # chunk chunks - 1 - c: the last at c 0
                         if not (stage == stages - 1 and c == 0)]}
        return out

    def received(self, recv_prev: bool, recv_next: bool) -> tuple[list[int], list[int]]:
        """The shapes of the next activation (``recv_prev``) and gradient (``recv_next``)."""
        out = [[0, 0, 0], [0, 0, 0]]
        for i, (wanted, kind) in enumerate(((recv_prev, "forward"), (recv_next, "backward"))):
            if wanted:
                out[i] = self.order[kind][self.taken[kind]]
                self.taken[kind] += 1
        return out[0], out[1]


def pipeline_communication(mconfig, parallel: MegatronParallel, p2p_communicator=None,
                           shapes: Optional[SlotShapes] = None) -> dict:
    """``p2p_communicator`` and ``pg_collection`` for Megatron's pipeline schedules with micro-
    batches of different lengths (``variable_seq_lengths``), correct with two stages interleaved.

    There the previous and the next stage are the same rank, and a call can send to it in both
    directions (the activation of one chunk, the gradient of another). Messages between two ranks
    match in the order they are posted: megatron-core 0.16's shape exchange posts the backward
    send before the forward one but receives the forward one first, so the shapes cross. Here the
    shapes go forward first, then backward (the receives in the same order); the tensors
    themselves go without ``batch_isend_irecv`` (`schedule_settings`), whose per-rank path
    sends each direction over its own group with two stages.

    ``parallel``: the job's layout; its `MegatronParallel.schedule_groups` are the schedule's
    ``pg_collection`` (the caller's collection when it gave one). ``p2p_communicator``: the
    caller's, whose pipeline group the communicator here uses (with its own shape exchange).
    ``shapes``: the schedule's `SlotShapes` (1F1B, or `SlotShapes.interleaved`), which answer
    the shape exchange without communicating; ``None`` (a plain data-parallel schedule): shapes
    are exchanged, in order."""
    pp_group = p2p_communicator.pp_group if p2p_communicator is not None \
        else parallel.pipeline_group
    communicator = _ordered_shapes_communicator()(pp_group, mconfig)
    communicator.slot_shapes = shapes
    return {"p2p_communicator": communicator, "pg_collection": parallel.schedule_groups}


@functools.cache
def _ordered_shapes_communicator():
    """Megatron's ``P2PCommunicator`` with the shape exchange of `pipeline_communication` (the
    class is made once, on first use: megatron-core is imported only then)."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_dcp.runtime.groups import comm_device

    class OrderedShapes(P2PCommunicator):
        slot_shapes: Optional[SlotShapes] = None

        def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
            if self.slot_shapes is not None:  # known here: nothing sent, nothing read
                return self.slot_shapes.received(recv_prev, recv_next)
            device = comm_device(self.pp_group)
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
                             SlotTimers(self.mconfig.timers, cuda=work.on_cuda))
        # interleaved: one iterator per chunk, each over every micro-batch
        data = [iter(steps) for _ in self.chunks] if interleaved else iter(steps)
        reduction = self.reduction if train else None
        if reduction is not None:  # every chunk's last backward is the last micro-batch's
            reduction.begin(shape_key(steps[-1].shard.task))
        with param_gathers(self.chunks), \
                schedule_settings(self.mconfig, interleaved, call.timers, reduction):
            get_forward_backward_func(self.parallel.pipeline, len(self.chunks) if interleaved
                                      else None)(
                forward_step_func=call.forward_step, data_iterator=data, model=self.chunks,
                num_microbatches=len(steps), seq_length=1, micro_batch_size=1,
                forward_only=not train,
                **pipeline_communication(self.mconfig, self.parallel, self.p2p_communicator,
                                         self._slot_shapes(steps, interleaved)))
        if reduction is not None:
            reduction.disarm()
        times = {id(step): (f, b) for step, f, b in call.timers.seconds()}  # this stage's
        for step in steps:
            work.record(step, call.losses.get(id(step)), *times.get(id(step), (None, None)))
        # the loss exists on the last stage only: every stage reports its pipeline's
        group = self.parallel.pipeline_group
        dist.broadcast(work.local_loss, src=dist.get_process_group_ranks(group)[-1], group=group)


    def _slot_shapes(self, steps: list, interleaved: bool) -> SlotShapes:
        """The shapes this stage's schedule receives, from the plan (`SlotShapes`)."""
        import torch.distributed as dist

        sp_tp = self.parallel.tensor if self.mconfig.sequence_parallel else 1
        if not interleaved:
            return SlotShapes(steps, self.mconfig.hidden_size, sp_tp)
        stages = self.parallel.pipeline
        return SlotShapes.interleaved(
            steps, self.mconfig.hidden_size, sp_tp, chunks=len(self.chunks),
            stage=dist.get_rank(self.parallel.pipeline_group), stages=stages,
            group=self.mconfig.microbatch_group_size_per_vp_stage or stages)


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
        out = token_losses(output_tensor, loss_mask, step.shard) if self.per_token else loss_sum
        loss = self.work.loss(step, out)
        self.losses[id(step)] = loss.detach()
        return loss, num_tokens, report
