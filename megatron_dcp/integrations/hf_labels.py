"""Hugging Face ``labels`` (``-100``: no loss) as DCP's per-token targets: a `WeightedBatch`.

HF causal LMs take labels *unshifted*: ``model(input_ids, labels=labels)`` shifts them inside
the model, so ``labels[i + 1]`` is the target of token ``i`` and ``labels[0]`` is never used.
DCP shards a sequence across ranks, so its targets must be fixed per token before the split
(docs/DESIGN.md, "Runtime"): `from_hf_labels` shifts each sequence's labels once, on the whole
sequence, and gives a `WeightedBatch` whose ``labels[i]`` is the target of token ``i`` and whose
weights are 1 where a target is trained, 0 where HF's label is -100 (a masked prompt, padding,
any hole inside a sequence). The loss under the default ``token`` reduction is then HF's own
(sum of cross-entropy over trained targets / their number over the whole global batch, as HF
computes it with ``num_items_in_batch``), whatever the plan.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from megatron_dcp.config import IGNORE_INDEX
from megatron_dcp.runtime.targets import WeightedBatch

__all__ = ["from_hf_labels"]


def from_hf_labels(input_ids: Any, labels: Any, attention_mask: Any = None, *,
                   scales: Optional[Sequence[Any]] = None,
                   norm: Optional[float] = None) -> WeightedBatch:
    """A `WeightedBatch` of sequences with HF's unshifted ``labels`` (-100: no loss).

    ``input_ids``: a list of 1-D token id tensors (``labels``: a list of as many tensors of the
    same lengths), or HF's padded ``[B, L]`` batch (``labels`` ``[B, L]``; ``attention_mask``
    ``[B, L]``, default all ones, marks each row's tokens: one run of 1s, padding left or right,
    which is dropped). ``scales`` and ``norm``: as `WeightedBatch` takes them (per sequence).
    Refuses (ValueError, naming the sequence) labels of another length, a label that is neither
    a token id nor -100, and a row whose mask is not one run."""
    rows = _rows(input_ids, labels, attention_mask)
    sequences, shifted = [], []
    for i, (ids, hf) in enumerate(rows):
        bad = (hf < 0) & (hf != IGNORE_INDEX)
        if bool(bad.any()):
            at = int(bad.nonzero()[0, 0])
            raise ValueError(f"hf_labels: sequence {i} has label {int(hf[at])} at position {at}:"
                             f" a label is a token id, or {IGNORE_INDEX} for no loss")
        sequences.append(ids)
        shifted.append(torch.cat([hf[1:], hf.new_full((min(len(hf), 1),), IGNORE_INDEX)]))
    return WeightedBatch(sequences, shifted, scales=scales, norm=norm)


def _rows(input_ids: Any, labels: Any, attention_mask: Any) -> list[tuple[torch.Tensor, ...]]:
    """Each sequence's (token ids, HF labels) on the host, checked (`from_hf_labels`)."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
        return _padded_rows(input_ids, labels, attention_mask)
    if attention_mask is not None:
        raise ValueError("hf_labels: attention_mask goes with a padded [B, L] input_ids tensor; "
                         "a list of sequences has no padding")
    if isinstance(labels, torch.Tensor) or len(labels) != len(input_ids):
        what = f"a {type(labels).__name__}" if isinstance(labels, torch.Tensor) else \
            f"{len(labels)} labels"
        raise ValueError(f"hf_labels: {what} for {len(input_ids)} sequences: give one 1-D "
                         "label tensor per sequence")
    rows = []
    for i, (ids, hf) in enumerate(zip(input_ids, labels)):
        ids = torch.as_tensor(ids).detach().reshape(-1).cpu()
        hf = torch.as_tensor(hf).detach().reshape(-1).to(device="cpu", dtype=torch.long)
        if hf.shape[0] != ids.shape[0]:
            raise ValueError(f"hf_labels: sequence {i} has {ids.shape[0]} tokens and "
                             f"{hf.shape[0]} labels (HF's labels are unshifted: one per token)")
        rows.append((ids, hf))
    return rows


def _padded_rows(input_ids: torch.Tensor, labels: Any,
                 attention_mask: Any) -> list[tuple[torch.Tensor, ...]]:
    """The rows of HF's padded batch without their padding (one run of 1s in the mask)."""
    labels = torch.as_tensor(labels)
    mask = torch.ones_like(input_ids) if attention_mask is None else \
        torch.as_tensor(attention_mask)
    for name, x in (("labels", labels), ("attention_mask", mask)):
        if tuple(x.shape) != tuple(input_ids.shape):
            raise ValueError(f"hf_labels: {name} of shape {tuple(x.shape)} for input_ids of "
                             f"shape {tuple(input_ids.shape)}")
    rows = []
    for i in range(input_ids.shape[0]):
        kept = mask[i].detach().cpu().nonzero().reshape(-1)
        if kept.numel() and int(kept[-1] - kept[0]) + 1 != kept.numel():
            raise ValueError(f"hf_labels: row {i}'s attention_mask is not one run of 1s (left "
                             "or right padding); pass packed documents as sequences of their own")
        lo, hi = (int(kept[0]), int(kept[-1]) + 1) if kept.numel() else (0, 0)
        rows.append((input_ids[i, lo:hi].detach().cpu(),
                     labels[i, lo:hi].detach().to(device="cpu", dtype=torch.long)))
    return rows
