"""Megatron DDP's two overlaps under DCP: the gradient reduction inside each rank's last
micro-step (``overlap_grad_reduce``) and the parameter all-gather behind the forward
(``overlap_param_gather``), each the same collectives in the same order on every rank whatever
its tasks.

* `grad_reduction`: Megatron's DDP reduces a bucket group from its backward hooks once every
  parameter's gradient is ready, in the micro-step where gradient sync is on, in the order the
  backward finishes them. Under DCP every micro-step runs in DDP's ``no_sync`` (Megatron's hooks
  only accumulate) and `megatron_dcp.runtime.overlap.OrderedReduction` starts the bucket groups
  in the rank's last micro-step, in one order (`_domains`), with the counts it learned per
  micro-step shape; ``finish`` starts the rest and Megatron's ``finalize_model_grads`` waits for
  them all (a bucket group already started is not started again: Megatron's
  ``start_grad_sync`` returns when its handle is set while DDP is in its first batch, which it
  stays in under DCP, as its hooks never count outside ``no_sync``).
* `param_gathers`: Megatron dispatches the all-gather of bucket group k from the forward
  pre-hook that waits for group k + 1, so the gathers follow each rank's forwards. Under DCP
  every bucket group's gather is dispatched at the start of the rank's micro-steps, in the order
  the forward uses them (Megatron's own chain: the last bucket group first), before any task's
  collective; the pre-hooks only wait (the DDP's ``overlap_param_gather_with_optimizer_step``,
  Megatron's switch for "already dispatched", is on for the step and restored after). A gather
  no forward waited for (a module no micro-step ran) is waited for after the micro-steps. So a
  rank runs the same gathers whatever its micro-steps, and every rank has gathered before its
  optimizer step.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from megatron_dcp.runtime.overlap import Bucket, OrderedReduction

_GROUPS = ("bucket_groups", "expert_parallel_bucket_groups")
"""The DDP's bucket groups: dense (over the data-parallel group), experts (their own group)."""


def _ddp_chunks(chunks: list, flag: str) -> list:
    """The chunks that are Megatron DDPs with ``ddp_config.<flag>`` on."""
    return [c for c in chunks if getattr(getattr(c, "ddp_config", None), flag, False)
            and hasattr(c, "bucket_groups")]


def _domains(chunks: list) -> list[list[Bucket]]:
    """The bucket groups in the order a step's backwards finish them, one list per
    communicator (dense, experts): the model chunks in reverse (an interleaved schedule runs
    the last chunk's last backward first), each chunk's bucket groups in its own order (the
    first holds the last layers' parameters, finished first)."""
    return [[Bucket(params=[p for bucket in group.buckets for p in bucket.params_list],
                    grads=[bucket.grad_data for bucket in group.buckets],
                    start=group.start_grad_sync)
             for chunk in reversed(chunks) for group in getattr(chunk, name, [])]
            for name in _GROUPS]


def grad_reduction(chunks: list) -> Optional[OrderedReduction]:
    """The ordered, overlapped reduction of the chunks whose DDP has ``overlap_grad_reduce``
    on (``None``: none has); its hooks stay on the parameters for the model's life."""
    ddps = _ddp_chunks(chunks, "overlap_grad_reduce")
    if not ddps:
        return None
    names = {id(p): name for chunk in ddps for name, p in chunk.named_parameters()}
    return OrderedReduction(_domains(ddps), names)


@contextmanager
def param_gathers(chunks: list) -> Iterator[None]:
    """Around a rank's micro-steps: every bucket group's parameter all-gather dispatched at
    the start, in forward order, the forward pre-hooks only waiting; after the micro-steps, the
    gathers no forward waited for are waited for (module docstring). Nothing where the DDP has
    no ``overlap_param_gather`` or its pre-hooks are off (Megatron-LM's evaluation and
    checkpointing gather synchronously)."""
    ddps = [c for c in _ddp_chunks(chunks, "overlap_param_gather")
            if getattr(c, "remove_forward_pre_hook_handles", None)]
    saved = [c.overlap_param_gather_with_optimizer_step for c in ddps]
    try:
        for chunk in ddps:
            chunk.overlap_param_gather_with_optimizer_step = True  # the pre-hooks only wait
            for name in _GROUPS:
                for group in reversed(getattr(chunk, name, [])):
                    if not group.param_gather_dispatched and group.param_gather_handle is None:
                        group.start_param_sync()
        yield
        for chunk in ddps:  # every rank gathered them all (a module no micro-step ran)
            for name in _GROUPS:
                for group in getattr(chunk, name, []):
                    if group.param_gather_handle is not None:
                        group.finish_param_sync(skip_next_bucket_dispatch=True)
    finally:
        for chunk, value in zip(ddps, saved):
            chunk.overlap_param_gather_with_optimizer_step = value
