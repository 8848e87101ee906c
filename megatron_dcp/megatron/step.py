"""A forward-backward function for Megatron-core models that runs a DCP plan.

`DCPForwardBackward` is called like Megatron's ``forward_backward_func``
(``megatron.core.pipeline_parallel.get_forward_backward_func()``) and returns the same list of
per-micro-step loss reports, so it drops into a Megatron training loop::

    forward_backward = DCPForwardBackward(dcp_config, model_shape=shape)
    losses_reduced = forward_backward(forward_step_func=forward_step, data_iterator=it,
                                      model=[model], num_microbatches=1, seq_length=0,
                                      micro_batch_size=1)

Differences to Megatron's schedules, all on purpose:

* ``data_iterator`` yields one *global batch* per call (a `GlobalBatch`, or a list of 1-D token
  tensors); the plan, not ``num_microbatches``, decides this rank's micro-steps (tasks), which
  differ between ranks. ``forward_step_func(data_iterator, model)`` is Megatron's usual one: it
  gets an iterator with one micro-batch dict (``tokens``, ``labels``, ``loss_mask``,
  ``position_ids``, ``attention_mask=None``, all ``[1, T_local]``: the task's shard) and returns
  ``(output_tensor, loss_func)``; ``loss_func(output_tensor)`` must return Megatron's per-token
  form ``(loss_sum, num_tokens, report)``.
* Loss: every shard's token-loss sum is scaled by 1/T (T = target tokens of the global batch,
  from the plan) before backward; Megatron's DDP must SUM gradients, so the model's config needs
  ``calculate_per_token_loss=True`` (checked). Gradients are finalised once per step
  (``config.finalize_model_grads_func`` or Megatron's ``finalize_model_grads``, with
  ``num_tokens=None`` because the 1/T is already applied); micro-steps run under DDP's
  ``no_sync`` so that uneven counts never start a reduction early. A rank without tasks still
  joins that reduction.
* Recompute: per task, the first ``task.ckpt_layers`` layers are recomputed through Megatron's
  own full/block recompute (``recompute_num_layers`` is read at every forward), set around the
  forward and restored after it.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan.plan import Plan
from megatron_dcp.runtime.context import current_task
from megatron_dcp.runtime.groups import GroupPool


@dataclass
class GlobalBatch:
    """The sequences of one optimizer step (index = plan sequence index) and optionally its plan."""

    sequences: Sequence[torch.Tensor]
    plan: Optional[Plan] = None


def _single_model(model):
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"DCP runs without (virtual) pipeline parallelism: expected one model "
                             f"chunk, got {len(model)}")
        return model[0]
    return model


def _tensor_parallel_size() -> int:
    """Megatron's tensor-parallel world size, 1 when its model parallelism is not set up."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return 1
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return int(parallel_state.get_tensor_model_parallel_world_size())


@contextmanager
def recompute_layers(config, num_layers: int) -> Iterator[None]:
    """Recompute the first ``num_layers`` transformer layers in the forwards run inside.

    Sets Megatron's full/block recompute on the (shared) TransformerConfig and restores it.
    """
    saved = (config.recompute_granularity, config.recompute_method, config.recompute_num_layers)
    if num_layers > 0:
        config.recompute_granularity, config.recompute_method = "full", "block"
        config.recompute_num_layers = num_layers
    elif saved[0] == "full":
        config.recompute_granularity = None
    try:
        yield
    finally:
        (config.recompute_granularity, config.recompute_method,
         config.recompute_num_layers) = saved


class DCPForwardBackward:
    """Megatron ``forward_backward_func`` replacement that executes one DCP plan per call.

    ``config``: the DCP settings (planner policy ...); ``model_shape``: `ModelShape` for the
    planner (needed unless every `GlobalBatch` carries its plan); ``pool``: a
    `megatron_dcp.runtime.groups.GroupPool` over the data-parallel ranks (built on first use);
    ``zero_stage``: 1 with Megatron's distributed optimizer, else 0 (the planner's memory model).
    """

    def __init__(self, config: DCPConfig, *, model_shape=None, pool=None, hardware=None,
                 zero_stage: int = 0) -> None:
        self.config = config
        # Memory the planner counts per rank for optimizer states: 0 = every rank holds them all
        # (Megatron's default), 1 = sharded over the data-parallel ranks
        # (--use-distributed-optimizer).
        self.zero_stage = zero_stage
        self.model_shape = model_shape
        self.pool = pool
        self.hardware = hardware
        self.iteration = 0
        self.last_plan: Optional[Plan] = None
        self.last_stats: Any = None
        self._report_keys: tuple[str, ...] = ("lm loss",)

    # ------------------------------------------------------------------ planning
    def plan_for(self, lengths: Sequence[int], world_size: int) -> Plan:
        """The plan of one global batch (deterministic: the same on every rank)."""
        from megatron_dcp.plan import make_plan

        if self.model_shape is None:
            raise ValueError("DCPForwardBackward: model_shape is needed to plan (or give "
                             "GlobalBatch(plan=...))")
        return make_plan(list(lengths), world_size=world_size, model=self.planning_shape(),
                         config=self.config, iteration=self.iteration, hardware=self.hardware,
                         zero_stage=self.zero_stage)

    def planning_shape(self):
        """The `ModelShape` the planner sees: the given one, with Megatron's tensor-parallel size
        filled in when the shape leaves it at 1 (memory and time are those of one TP rank)."""
        shape = self.model_shape
        if shape.tensor_parallel == 1:
            tp = _tensor_parallel_size()
            if tp > 1:
                shape = dataclasses.replace(shape, tensor_parallel=tp)
        return shape

    def _group_pool(self):
        """The pool of the data-parallel ranks (this rank's DCP world), built on first use."""
        if self.pool is None:
            import torch.distributed as dist
            from megatron.core import parallel_state

            dp_group = parallel_state.get_data_parallel_group()
            self.pool = GroupPool(world_ranks=dist.get_process_group_ranks(dp_group))
        return self.pool

    # ------------------------------------------------------------------ the step
    def __call__(self, *, forward_step_func: Callable, data_iterator, model,
                 num_microbatches: Optional[int] = None, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, decoder_seq_length=None,
                 forward_only: bool = False, collect_non_loss_data: bool = False,
                 first_val_step=None, adjust_tensor_shapes_fn=None, p2p_communicator=None,
                 pg_collection=None) -> list[dict]:
        """Run this rank's tasks of the next global batch; returns the loss reports."""
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        from megatron_dcp.megatron.parallel import enable_task_cp_groups
        from megatron_dcp.megatron.spec import prepare_model
        from megatron_dcp.runtime.executor import run_plan

        if collect_non_loss_data:
            raise ValueError("DCPForwardBackward: collect_non_loss_data is not supported")
        model = _single_model(model)
        mconfig = get_model_config(model)
        if not forward_only and not mconfig.calculate_per_token_loss:
            raise ValueError("DCP needs calculate_per_token_loss=True in the model's "
                             "TransformerConfig (Megatron's DDP must SUM gradients over "
                             "data-parallel ranks; DCP applies 1/T itself)")
        batch = next(data_iterator)
        if not isinstance(batch, GlobalBatch):
            batch = GlobalBatch(sequences=list(batch))
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        plan = batch.plan or self.plan_for([int(s.numel()) for s in batch.sequences], dp_size)
        if plan.world_size != dp_size:
            raise ValueError(f"plan for a DCP world of {plan.world_size} ranks, but the "
                             f"data-parallel size is {dp_size}")
        if not forward_only:  # evaluation does not advance the training iteration plans see
            self.iteration += 1
        self.last_plan = plan
        prepare_model(model)
        enable_task_cp_groups()
        pool = self._group_pool()
        per_token = self.config.loss_reduction == "sequence"

        reports: list[dict] = []

        def forward_step(input_ids, position_ids, labels):
            ctx = current_task()
            loss_mask = (labels != -100).to(torch.float32)
            micro_batch = {
                "tokens": input_ids.view(1, -1),
                "labels": labels.clamp(min=0).view(1, -1),
                "loss_mask": loss_mask.view(1, -1),
                "position_ids": position_ids.view(1, -1),
                "attention_mask": None,
            }
            depth = ctx.ckpt_layers if ctx is not None and not forward_only else 0
            with recompute_layers(mconfig, depth):
                output_tensor, loss_func = forward_step_func(iter([micro_batch]), model)
            outputs = loss_func(output_tensor)
            if len(outputs) != 3:
                raise ValueError("DCP needs the per-token loss_func form (loss_sum, num_tokens, "
                                 "report); got a 2-tuple (mean loss)")
            loss_sum, _num_tokens, report = outputs
            reports.append(report)
            self._report_keys = tuple(report)
            if per_token:  # run_plan weights every token by its sequence's 1/(S * targets)
                return output_tensor.reshape(-1).float() * loss_mask
            return loss_sum

        def backward(scaled_loss):
            if forward_only:
                return
            if mconfig.grad_scale_func is not None:
                scaled_loss = mconfig.grad_scale_func(scaled_loss)
            scaled_loss.backward()

        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else None
        no_sync = model.no_sync() if hasattr(model, "no_sync") and not forward_only \
            else nullcontext()
        grad_mode = torch.no_grad() if forward_only else nullcontext()
        with no_sync, grad_mode:
            self.last_stats = run_plan(plan, list(batch.sequences), dp_rank, forward_step,
                                       pool=pool, backward=backward,
                                       loss_reduction=self.config.loss_reduction,
                                       device=device)
        if not forward_only:
            finalize = mconfig.finalize_model_grads_func
            if finalize is None:
                from megatron.core.distributed import finalize_model_grads as finalize
            if hasattr(model, "finish_grad_sync"):
                finalize([model], None)
            else:  # a bare module (no Megatron DDP): SUM-reduce over the data-parallel group
                from megatron_dcp.runtime.executor import reduce_gradients

                reduce_gradients([p for p in model.parameters() if p.requires_grad],
                                 parallel_state.get_data_parallel_group())
        if not reports:  # a rank without tasks reports zero tokens (Megatron sums the reports)
            reports.append({k: torch.zeros(2) for k in self._report_keys})
        return reports
