"""The launcher's global batch without sending every token to every rank: the Megatron side of
the runtime's lengths-first input stage (`megatron_dcp.runtime.input_stage`).

The data-parallel sources are the ranks Megatron-LM gives the batch (the first pipeline stage's
tensor-parallel rank 0 of each data-parallel rank); each cuts its micro-batches into `documents`
and says what is wrong with them (`token_id_problem`). Every rank then learns every document's
length, plans, and receives, in one exchange on a host (gloo) group, the tokens of its own
tasks' documents only (every tensor- and pipeline-parallel rank of a data-parallel rank gets its
tasks' documents): `global_batch`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from megatron_dcp.plan.plan import Plan
from megatron_dcp.runtime import input_stage
from megatron_dcp.runtime.input_stage import (exchange, gather_lengths, host_group,  # noqa: F401
                                              needed_by)


def global_batch(local: Optional[list[np.ndarray]], dp_rank: int, problem: str,
                 plan_of: Callable[[list[int]], Plan],
                 group: Any = None) -> tuple[list[Optional[torch.Tensor]], Plan]:
    """This rank's view of the step's global batch and its plan
    (`megatron_dcp.runtime.input_stage.global_batch`). ``local``: this rank's documents if it is
    a source (else None); ``problem``: why a source refuses its documents ("" for none): raised
    on every rank alike, before any plan; ``group``: the host group over the job
    (`host_group`)."""
    batch = input_stage.global_batch(local, dp_rank, problem, plan_of, group)
    return batch.sequences, batch.plan


def documents(batch: dict) -> list[torch.Tensor]:
    """The documents of one Megatron-LM batch (``[mbs, S]`` tensors, ``cu_seqlens`` padded
    with ``S``): for each document, its tokens and then the target of its last token (so DCP's
    next-token targets are exactly the batch's ``labels``: across a document boundary, and at
    the end of the sample). Where the loss mask drops the last token's target only
    (``--eod-mask-loss`` masks the target of each EOD token, the last of its document) the
    document is its tokens alone: its last token has no target, as in Megatron-LM. Refuses a
    loss mask that drops any other target of a document."""
    tokens, labels = batch["tokens"].cpu(), batch["labels"].cpu()
    mask, cu_rows = batch["loss_mask"].cpu(), batch["cu_seqlens"].cpu()
    out = []
    for row in range(tokens.shape[0]):
        cu = cu_rows[row].tolist()
        bounds = [0] + [c for i, c in enumerate(cu[1:], 1) if c > cu[i - 1]]
        for a, b in zip(bounds, bounds[1:]):
            kept = mask[row, a:b] > 0
            if bool(kept.all()):
                out.append(torch.cat([tokens[row, a:b], labels[row, b - 1:b]]).to(torch.long))
            elif bool(kept[:-1].all()):  # its last target masked: --eod-mask-loss's EOD
                out.append(tokens[row, a:b].to(torch.long))
            else:
                raise ValueError(f"--dcp: sample {row} has loss-masked tokens inside its "
                                 f"document [{a}, {b}): DCP trains every next-token target of "
                                 "a document but its last (--eod-mask-loss masks that one)")
    return out


def token_id_problem(sequences: list, vocab_size: int) -> str:
    """Why a batch holding a token id outside ``[0, vocab_size)`` is refused (``""`` when it
    holds none): at or above the tokenizer's vocabulary an id trains the embedding's padding rows
    (or fails inside a task past them). Names the document, the id and what to change."""
    for i, seq in enumerate(sequences):
        if len(seq) and (int(seq.max()) >= vocab_size or int(seq.min()) < 0):
            bad = int(seq.max()) if int(seq.max()) >= vocab_size else int(seq.min())
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
