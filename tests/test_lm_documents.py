"""The launcher's documents of a Megatron-LM batch (`megatron_dcp.megatron.lm_data.documents`): each
document is its tokens and its last token's target (the sample's label there); where the loss
mask drops the last target only (``--eod-mask-loss``: the EOD token's) the document has no last
target, as in Megatron-LM's loss; any other masked target is refused, naming the document."""

from __future__ import annotations

import pytest
import torch

from megatron_dcp.megatron.lm_data import documents

EOD = 9


def _batch(mask_at: tuple = ()) -> dict:
    """One 8-token sample of documents [0, 3) and [3, 8) (EOD ends the first); the extra token
    (the next sample's first) is 7."""
    tokens = torch.tensor([[1, 2, EOD, 4, 5, 6, 7, 8]])
    labels = torch.tensor([[2, EOD, 4, 5, 6, 7, 8, 7]])
    mask = torch.ones(1, 8)
    for i in mask_at:
        mask[0, i] = 0
    return {"tokens": tokens, "labels": labels, "loss_mask": mask,
            "cu_seqlens": torch.tensor([[0, 3, 8, 8, 8]])}


def test_each_document_carries_its_last_target():
    docs = documents(_batch())
    assert [d.tolist() for d in docs] == [[1, 2, EOD, 4], [4, 5, 6, 7, 8, 7]]
    # next-token targets inside the documents equal the batch's labels
    assert sum(d.numel() - 1 for d in docs) == 8


def test_a_masked_eod_target_ends_its_document_without_a_target():
    docs = documents(_batch(mask_at=(2,)))
    assert [d.tolist() for d in docs] == [[1, 2, EOD], [4, 5, 6, 7, 8, 7]]
    assert sum(d.numel() - 1 for d in docs) == 7  # Megatron-LM's loss mask sum


def test_a_target_masked_inside_a_document_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"sample 0 .* document \[3, 8\)"):
        documents(_batch(mask_at=(5,)))
