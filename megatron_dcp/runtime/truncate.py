"""The global batch cut as the plan truncated it (``dcp.oversize`` truncate).

The planner shortens a sequence that fits no group to the longest length that fits and records
it (`Plan.truncated`: the sequence and its length before); the batch handed to the step still
holds the whole sequence. `cut_to_plan` keeps each truncated sequence's first ``plan.lengths[i]``
tokens, once, in the step driver, for every engine: the kept prefix is then an ordinary sequence
of that length (its next-token targets are its own tokens 1..n-1, the last token has none), so
the step equals single-process training on the truncated batch. Only the sequences the plan
names are cut: any other length that differs from the plan stays a `BatchError` of the plan check.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_dcp.plan.plan import Plan
from megatron_dcp.runtime.targets import SelfTargetBatch, WeightedBatch


def truncated_tokens(plan: Optional[Plan]) -> tuple[int, int]:
    """(sequences truncated, tokens cut from them) of ``plan`` (0, 0 without one)."""
    if plan is None:
        return 0, 0
    return len(plan.truncated), plan.truncated_tokens


def cut_to_plan(plan: Plan, sequences: Sequence[Optional[torch.Tensor]]
                ) -> Sequence[Optional[torch.Tensor]]:
    """``sequences`` with every sequence the plan truncated cut to its planned length (a view:
    no copy); the batch itself when the plan truncated none. A `SelfTargetBatch` stays one (its
    content digests, and the frame sizes the plan holds). Entries that are ``None`` (a rank
    that holds only its own tasks' sequences) or already short enough are left as they are."""
    cut = plan.truncated
    if not cut:
        return sequences
    out = list(sequences)
    for i in cut:
        if 0 <= i < len(out) and out[i] is not None and out[i].dim() == 1 \
                and out[i].shape[0] > plan.lengths[i]:
            out[i] = out[i][:plan.lengths[i]]
    if isinstance(sequences, WeightedBatch):
        return sequences.cut(plan.lengths)
    if isinstance(sequences, SelfTargetBatch):
        frames = list(plan.frame_tokens) if plan.frame_tokens is not None \
            else sequences.frame_tokens
        return SelfTargetBatch(out, sequences.content_digests, frames)
    return out
