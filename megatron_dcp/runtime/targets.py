"""What a token's loss target is, and the weight of its loss: the exact loss of a DCP step.

Labels are next-token targets computed on each *whole* sequence before it is sharded, so the
last token of a shard keeps its target from the next shard; a sequence's last token gets -100.
With ``targets="self"`` (a `SelfTargetBatch`: every token is its own target, e.g. the latent rows
of a video diffusion model) the label of a token is its own id and all ``n`` tokens of a sequence
count.

Weights: ``token`` reduction scales the summed token losses by ``1 / T`` (``T =
target_count(plan, targets)``, the target tokens of the *global* batch); ``sequence`` weights
every token by ``1 / (S * targets of its sequence)``. The SUM of gradients over the DCP world then
equals the gradient of single-device training on the whole batch. `target_weights` is shared by
the executor (`megatron_dcp.runtime.executor.PlanWork`) and the engines' plain data-parallel
baselines, so both optimise the same loss.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from megatron_dcp.config import IGNORE_INDEX, LOSS_REDUCTIONS
from megatron_dcp.plan.plan import Plan, Task

__all__ = ["TARGET_KINDS", "SelfTargetBatch", "batch_targets", "packed_inputs",
           "sequence_weighting", "target_count", "target_weights", "weighted_loss"]

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


def packed_inputs(task: Task, sequences: Sequence[torch.Tensor], weight_of: Callable,
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


def sequence_weighting(plan: Plan, loss_reduction: str, targets: str) -> Callable[[int], float]:
    """Loss weight of every target token of sequence ``s`` (over the sequences the plan runs)."""
    planned = sorted({s for t in plan.tasks for s in t.seqs})
    weights = target_weights([plan.lengths[s] for s in planned], loss_reduction, targets)
    return dict(zip(planned, weights)).__getitem__


def weighted_loss(out: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
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
