"""The launcher's global batch without sending every token to every rank: the Megatron side of
the runtime's lengths-first input stage (`megatron_dcp.runtime.input_stage`).

The data-parallel sources are the ranks Megatron-LM gives the batch (the first pipeline stage's
tensor-parallel rank 0 of each data-parallel rank); each cuts its micro-batches into `documents`
and says what is wrong with them (`token_id_problem`). Every rank then learns every document's
length, plans, and receives, in one exchange on a host (gloo) group, the tokens of its own
tasks' documents only (every tensor- and pipeline-parallel rank of a data-parallel rank gets its
tasks' documents), with their labels and loss masks (Megatron-LM's own, so any mask trains as
in Megatron-LM: ``--eod-mask-loss``, ``--sft``): `global_batch`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from megatron_dcp.config import IGNORE_INDEX
from megatron_dcp.plan.plan import Plan
from megatron_dcp.runtime import input_stage
from megatron_dcp.runtime.input_stage import (exchange, gather_lengths, host_group,  # noqa: F401
                                              needed_by)
from megatron_dcp.runtime.targets import WeightedBatch


def global_batch(local: Optional[list], dp_rank: int, problem: str,
                 plan_of: Callable[[list[int]], Plan],
                 group: Any = None) -> tuple[list[Optional[torch.Tensor]], Plan]:
    """This rank's view of the step's global batch and its plan
    (`megatron_dcp.runtime.input_stage.global_batch`). ``local``: this rank's documents if it is
    a source (else None; a `WeightedBatch` of `documents`: the batch is then a `WeightedBatch`
    on every rank, each document's labels and loss mask with its tokens); ``problem``: why a
    source refuses its documents ("" for none): raised on every rank alike, before any plan;
    ``group``: the host group over the job (`host_group`)."""
    batch = input_stage.global_batch(local, dp_rank, problem, plan_of, group)
    return batch.sequences, batch.plan


def documents(*batches: dict) -> WeightedBatch:
    """The documents of Megatron-LM batches (``[mbs, S]`` tensors, ``cu_seqlens`` padded
    with ``S``), in order, with Megatron-LM's own targets: each document is its tokens, with its
    ``labels`` and ``loss_mask`` as the batch holds them (a `WeightedBatch`: the label of a
    document's last token is the batch's, the next document's first token or the sample's
    extra one; a masked target has weight 0). So DCP's loss is Megatron-LM's per-token loss
    whatever its mask: ``--eod-mask-loss`` with EOD ids anywhere, ``--sft``'s masked prompts
    and padding; and a document filling a sample is exactly ``--seq-length`` tokens."""
    docs, targets, weights = [], [], []
    for batch in batches:
        tokens, labels = batch["tokens"].cpu(), batch["labels"].cpu()
        mask, cu_rows = batch["loss_mask"].cpu(), batch["cu_seqlens"].cpu()
        for row in range(tokens.shape[0]):
            cu = cu_rows[row].tolist()
            bounds = [0] + [c for i, c in enumerate(cu[1:], 1) if c > cu[i - 1]]
            for a, b in zip(bounds, bounds[1:]):
                docs.append(tokens[row, a:b].to(torch.long))
                targets.append(labels[row, a:b].to(torch.long))
                weights.append(mask[row, a:b].to(torch.float64))
    return WeightedBatch(docs, targets, weights)


def token_id_problem(sequences: list, vocab_size: int) -> str:
    """Why a batch holding a token id outside ``[0, vocab_size)`` is refused (``""`` when it
    holds none): at or above the tokenizer's vocabulary an id trains the embedding's padding rows
    (or fails inside a task past them). The trained targets of a `WeightedBatch` count too (a
    document's last label is a token of the next one). Names the document, the id and what to
    change."""
    labels = getattr(sequences, "labels", None) or [None] * len(sequences)
    for i, (seq, label) in enumerate(zip(sequences, labels)):
        ids = np.asarray(seq)
        if label is not None:
            ids = np.concatenate([ids, label[label != IGNORE_INDEX].numpy()])
        if len(ids) and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
            return (f"--dcp: document {i} of this step holds token id {bad}, outside the "
                    f"tokenizer's vocabulary of {vocab_size} (ids 0..{vocab_size - 1}): the data "
                    "was tokenized with another vocabulary; give the tokenizer it was made with "
                    "(--vocab-size for NullTokenizer: dcp-build-dataset's data needs 257)")
    return ""


def check_token_ids(sequences: list, vocab_size: int) -> None:
    """`token_id_problem`, raised."""
    problem = token_id_problem(sequences, vocab_size)
    if problem:
        raise ValueError(problem)
