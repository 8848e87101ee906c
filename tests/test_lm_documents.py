"""The launcher's documents of a Megatron-LM batch (`megatron_dcp.megatron.lm_data.documents`,
issue 57 item 2, issue 60 item 2): each document is its tokens with Megatron-LM's own labels and
loss mask (a `WeightedBatch`): the label of its last token is the batch's (the next document's
first token, or the sample's extra token), a masked target anywhere in a document (an EOD id
inside it under ``--eod-mask-loss``, ``--sft``'s prompts and padding) has weight 0, and a
document that fills a sample is exactly ``--seq-length`` tokens."""

from __future__ import annotations

import pytest
import torch

from megatron_dcp.megatron.lm_data import documents, token_id_problem
from megatron_dcp.runtime.targets import WeightedBatch

EOD = 9


def _batch(mask_at: tuple = (), cu: tuple = (0, 3, 8, 8, 8)) -> dict:
    """One 8-token sample of documents [0, 3) and [3, 8) (EOD ends the first); the extra token
    (the next sample's first) is 7: the last label."""
    tokens = torch.tensor([[1, 2, EOD, 4, 5, 6, 7, 8]])
    labels = torch.tensor([[2, EOD, 4, 5, 6, 7, 8, 7]])
    mask = torch.ones(1, 8)
    for i in mask_at:
        mask[0, i] = 0
    return {"tokens": tokens, "labels": labels, "loss_mask": mask,
            "cu_seqlens": torch.tensor([list(cu)])}


def test_each_document_is_its_tokens_with_the_batchs_labels():
    docs = documents(_batch())
    assert isinstance(docs, WeightedBatch)
    assert [d.tolist() for d in docs] == [[1, 2, EOD], [4, 5, 6, 7, 8]]
    # the last token's label is the batch's: across the boundary, and the sample's extra token
    assert [lab.tolist() for lab in docs.labels] == [[2, EOD, 4], [5, 6, 7, 8, 7]]
    assert docs.sums == [(3.0, 3), (5.0, 5)]  # every target trained: 8, Megatron-LM's count


def test_a_document_filling_its_sample_has_seq_length_tokens():
    """Issue 60 item 2: no carried target token, so sequence length = ranks x tokens per rank
    holds a sample's one document."""
    docs = documents(_batch(cu=(0, 8, 8)))
    assert [len(d) for d in docs] == [8]
    assert docs.labels[0].tolist() == [2, EOD, 4, 5, 6, 7, 8, 7]


def test_a_masked_target_anywhere_has_weight_zero():
    """The EOD's target (``--eod-mask-loss``) and a target inside a document (an EOD id inside
    it, an SFT prompt): weight 0 and label -100, Megatron-LM's loss mask; nothing refused."""
    docs = documents(_batch(mask_at=(2, 5)))
    assert [w.tolist() for w in docs.weights] == [[1, 1, 0], [1, 1, 0, 1, 1]]
    assert [lab.tolist() for lab in docs.labels] == [[2, EOD, -100], [5, 6, -100, 8, 7]]
    assert sum(n for _, n in docs.sums) == 6  # Megatron-LM's loss mask sum


def test_the_micro_batches_of_a_step_in_order():
    docs = documents(_batch(), _batch(mask_at=(0,)))
    assert len(docs) == 4 and docs.weights[2].tolist() == [0, 1, 1]


def test_a_trained_label_outside_the_vocabulary_is_named():
    docs = documents(_batch())
    assert token_id_problem(docs, 10) == ""
    docs.labels[1][-1] = 12  # the sample's extra token: a label, no document's token
    assert "document 1 of this step holds token id 12" in token_id_problem(docs, 10)


def _plan(lengths: list, cap: int):
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import load_model, make_plan

    return make_plan(lengths, world_size=2, model=load_model("llama-7b"),
                     config=DCPConfig(enabled=True, hardware="h200", max_tokens_per_rank=cap,
                                      memory_budget_gb=None))


def test_ranks_x_tokens_per_rank_holds_a_sequence_and_one_more_token_names_the_cap():
    """Issue 60 item 2 at the boundary: 2 ranks x 512 tokens hold a 1,024-token document at
    degree 2; one token more fails, and the error says which cap holds it (the sequence padded
    for its layout: 1,028 tokens on 2 ranks)."""
    from megatron_dcp.plan.plan import PlanError

    plan = _plan([1024, 100], 512)
    assert [t.degree for t in plan.tasks if 0 in t.seqs] == [2]
    with pytest.raises(PlanError, match=r"sequence 0 has 1025 tokens .* "
                                        r"dcp\.max_tokens_per_rank 514 holds its 1025 tokens on "
                                        r"2 ranks"):
        _plan([1025, 100], 512)
