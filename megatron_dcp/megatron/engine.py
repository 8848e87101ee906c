"""`MegatronStepEngine`: Megatron's `StepEngine` (`megatron_dcp.runtime.step_engine`) for one
call of `DCPForwardBackward` without pipeline parallelism, over the job's Megatron layout
(`megatron_dcp.megatron.parallel.MegatronParallel`, which the step passes it).

Each micro-step is one call of Megatron's ``forward_step_func`` on a one-micro-batch iterator that
carries the task and its recomputed layers as ``packed_seq_params``; the micro-steps run in DDP's
``no_sync`` and the gradients are finalised once (``finalize_model_grads``). With DDP's
``overlap_grad_reduce`` the bucket groups are reduced inside the rank's last micro-step's
backward, in one order on every rank (``reduction``), and with ``overlap_param_gather`` the
parameter all-gathers are dispatched when the micro-steps start (`megatron_dcp.megatron.overlap`).
With pipeline
parallelism `megatron_dcp.megatron.pipeline_engine.MegatronPipelineEngine` runs the same
micro-steps through Megatron's schedule.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, Optional

import torch

from megatron_dcp.config import IGNORE_INDEX
from megatron_dcp.megatron.overlap import param_gathers
from megatron_dcp.megatron.parallel import MegatronParallel
from megatron_dcp.runtime.executor import PlanWork
from megatron_dcp.runtime.overlap import OrderedReduction, shape_key
from megatron_dcp.runtime.step import Shard, StepEngine


def token_losses(output_tensor, loss_mask, shard: Shard) -> torch.Tensor:
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
        self.reduction: Optional[OrderedReduction] = None
        """The overlapped gradient reduction of the model (DDP's ``overlap_grad_reduce``; kept
        by the step across calls: it learns per micro-step shape), ``None``: reduced in
        `finish`."""
        self._task = None  # the task of the micro-step whose forward ran last

    def run_micro_steps(self, work: PlanWork, per_token: bool, train: bool) -> None:
        """The driver's loop, with DDP's parameter all-gathers dispatched before it
        (`param_gathers`)."""
        with param_gathers(self.chunks):
            super().run_micro_steps(work, per_token, train)

    def forward_loss(self, shard: Shard, per_token: bool) -> torch.Tensor:
        """Megatron's ``forward_step_func`` and ``loss_func`` on one shard; the task (and its
        recomputed layers) travels in the micro-batch's ``packed_seq_params``."""
        self._task = shard.task
        output_tensor, loss_func, loss_mask = self._forward(shard)
        loss_sum, _num_tokens, _report = self._loss(loss_func, output_tensor)
        if per_token:  # the driver weights every token by its sequence's 1/(S * targets)
            return token_losses(output_tensor, loss_mask, shard)
        return loss_sum

    def _forward(self, shard: Shard, model=None):
        """``forward_step_func`` on the shard's micro-batch through ``model`` (default: the one
        chunk): (output, loss_func, loss mask).
        Under sequence parallelism the micro-batch is padded at its end to a multiple of the TP
        size (padding: token 0, position 0, loss mask 0; attention skips it). The engine keeps
        the run's `TaskRun` (its offload stash; whether a DCP layer ran)."""
        from megatron_dcp.megatron.spec import DCPTaskParams, TaskRun

        tp = self.parallel.tensor if self.mconfig.sequence_parallel else 1
        pad = -shard.labels.numel() % tp

        def pad_end(x, value=0):
            return torch.nn.functional.pad(x, (0, pad), value=value).view(1, -1)

        run = TaskRun.of(shard.task, train=not self.forward_only)
        params = DCPTaskParams.of(shard.task, train=not self.forward_only, sp_pad=pad, run=run)
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
        if params is not None and not run.reached:
            raise ValueError(
                f"task {shard.task.id}: no DCP layer ran with the micro-batch's "
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
        """One micro-step's backward; in the rank's last one (``last``) the overlapped
        reduction starts the bucket groups whose gradients are final (``reduction``)."""
        if self.mconfig.grad_scale_func is not None:
            loss = self.mconfig.grad_scale_func(loss)
        reduction = self.reduction if last else None
        if reduction is not None:
            reduction.begin(shape_key(self._task))
            reduction.arm()
        try:
            loss.backward()
        finally:
            if reduction is not None:
                reduction.disarm()

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
        before the update), else ``None`` (not computed: Megatron's optimizer does). With the
        overlapped reduction the buckets the last backward did not start are started first, and
        each bucket's own gradients were probed just before its reduction started."""
        import torch.distributed as dist

        from megatron_dcp.runtime.groups import comm_device
        from megatron_dcp.runtime.nonfinite import nonfinite_gradient_ranks

        reduction = self.reduction
        if reduction is not None:  # the rest of the buckets; their probes before each
            reduction.dispatch_rest()
        grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None
                 else p.grad for c in self.chunks for p in c.parameters()
                 if p.requires_grad and not (reduction is not None and reduction.covers(p))]
        grads += reduction.probes if reduction is not None else []
        self.nonfinite_ranks = nonfinite_gradient_ranks(grads, dist.get_rank(),
                                                        dist.get_world_size(), None,
                                                        comm_device())
        self._reduce()
        return float("nan") if self.nonfinite_ranks else None

    def skip_update(self) -> None:
        """A skipped step (the caller skips the optimizer): the reductions the last backward
        started are finished (with the rest, in order, on every rank: every rank skips
        alike), so the next step starts with none in flight."""
        if self.reduction is not None:
            self.reduction.dispatch_rest()
            for chunk in self.chunks:
                if hasattr(chunk, "finish_grad_sync"):
                    chunk.finish_grad_sync()

    @property
    def scales_loss(self) -> bool:
        """fp16: Megatron's mixed-precision optimizer (the caller's) holds a loss scaler that
        skips an overflow step in its own ``step()`` and backs its scale off; the driver leaves
        such steps to it (stopping would end every fp16 run at its first, overflowing, scale)."""
        return bool(getattr(self.mconfig, "fp16", False))

    def update_applied(self) -> bool:
        """``finish`` applies no update: the caller steps the optimizer. Without fp16 the caller
        skips that step on ``StepResult.skipped`` (False: still skippable); with fp16 the loss
        scaler decides: True unless a gradient overflowed (``nonfinite_ranks``), when
        ``StepResult.skipped`` says the scaler will skip it (the caller still calls ``step()``,
        which backs the scale off)."""
        return self.scales_loss and not self.nonfinite_ranks

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
