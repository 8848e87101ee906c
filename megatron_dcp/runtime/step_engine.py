"""`StepEngine`: what an engine supplies to `megatron_dcp.runtime.step.StepDriver`.

An engine subclasses `StepEngine`. Required:

* ``forward_loss(shard, per_token)``: forward and loss of one shard (sum of token losses, or
  per-token losses for the ``sequence`` reduction); ``shard.task`` is the task, to be passed on
  to the model as an argument (nothing else carries it: recomputation on CUDA's autograd thread
  sees it because the model was called with it);
* ``backward(loss, last)``: backward of one micro-step; ``last`` marks the rank's last one (the
  accumulation boundary);
* ``finish()``: reduce gradients and step the optimizer; returns the gradient norm or ``None``.

Optional, declared on `StepEngine` with the default an engine gets when it does not set them:

* ``equal_micro_steps`` (False): every rank must run the same number of micro-steps (the driver
  pads a free plan with empty ones: plain data parallel under DeepSpeed);
* ``reduction_scope()`` (a null context): the reduction scope around the rank's micro-steps
  (Megatron's ``no_sync``, DeepSpeed's coalesced reduction);
* ``run_micro_steps(work, per_token, train)`` (the driver's loop): run all micro-steps of the
  `PlanWork`, reporting each with ``work.record``; a pipeline schedule overrides it (it
  interleaves their forwards and backwards);

and for a step whose loss or gradient norm is not finite (`megatron_dcp.runtime.nonfinite`:
stopped before ``finish``, or with ``DCPConfig.skip_nonfinite`` skipped):

* ``scales_loss`` (False): the engine skips overflow steps itself (an fp16 loss scaler): the
  driver then leaves such a step to the engine and counts it as skipped;
* ``skip_update()`` (nothing): discard the step's gradients without an update (nothing to do
  when the caller steps the optimizer, e.g. Megatron's example, and skips it on
  ``StepResult.skipped``);
* ``update_applied()`` (True): whether ``finish`` applied its update;
* ``nonfinite_ranks`` (none): after ``finish``, the ranks whose own gradients were not finite
  (a mapping by rank, as `describe_ranks` takes; named in the error of a non-finite norm).

A *lockstep* plan (`Plan.lockstep`, planned for ZeRO-2/3) needs no more of the engine: every rank
runs every slot, its task of the slot or, in a slot where it has none, an empty task: one
two-token sequence on this rank alone, with the slot's recomputed layers and a loss multiplied by
zero, run through ``forward_loss`` and ``backward`` like any task. So it calls the same modules
(ZeRO-3's per-module all-gathers, their recompute) and joins the same reductions (ZeRO-2's
per-micro-step reduce-scatter) as the ranks with work in that slot.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import MappingProxyType
from typing import Any, ContextManager, Mapping, Optional

import torch

from megatron_dcp.runtime.executor import PlanWork, Shard

__all__ = ["StepEngine"]


class StepEngine:
    """What an engine supplies to `StepDriver`: subclass it, implement `forward_loss`,
    `backward` and `finish`, and set or override the optional members (their defaults here are
    what an engine gets without them; the module docstring lists them)."""

    equal_micro_steps: bool = False
    """Every rank must run the same number of micro-steps (padded with empty ones)."""
    scales_loss: bool = False
    """The engine skips overflow steps itself (an fp16 loss scaler)."""
    nonfinite_ranks: Mapping[int, Optional[int]] = MappingProxyType({})
    """After `finish`: the ranks whose own gradients were not finite (none by default)."""

    def forward_loss(self, shard: Shard, per_token: bool) -> torch.Tensor:
        """Forward and loss of one shard: the sum of its token losses, or per-token losses."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-step; ``last``: the rank's last one (accumulation boundary)."""
        raise NotImplementedError

    def finish(self) -> Optional[float]:
        """Reduce the gradients and step the optimizer; the gradient norm or ``None``."""
        raise NotImplementedError

    def reduction_scope(self) -> ContextManager[Any]:
        """The reduction scope around the rank's micro-steps (default: none)."""
        return nullcontext()

    def run_micro_steps(self, work: PlanWork, per_token: bool, train: bool) -> None:
        """Run every micro-step of ``work`` in order (forward, weighted loss, backward) and
        report each (``work.record``). An engine whose schedule interleaves micro-steps (a
        pipeline) overrides it."""
        for step in work:
            with work.running(step):
                loss = work.loss(step, self.forward_loss(step.shard, per_token))
                if train:
                    self.backward(loss, step.last)
            work.record(step, loss)

    def skip_update(self) -> None:
        """Discard the step's gradients without an update (default: nothing to discard)."""

    def update_applied(self) -> bool:
        """Whether the last `finish` applied its update (default: True)."""
        return True
