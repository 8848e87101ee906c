"""The launcher's global batch without sending every token to every rank.

Each data-parallel source (the first pipeline stage's tensor-parallel rank 0 of each
data-parallel rank: the ranks Megatron-LM gives the batch) cuts its micro-batches into documents.
Then, every step:

1. every rank learns every document's length and whether any source refused its documents
   (`dist.all_gather_object` of lengths only: a few bytes a document);
2. every rank plans the batch from the lengths (the same plan everywhere: the driver checks it);
3. each document's tokens go, in one ``all_to_all_single`` over the job, only to the ranks
   whose data-parallel rank runs a task holding it (every tensor- and pipeline-parallel rank of
   it), never pickled.

Both collectives run on a host (gloo) group over the job (`host_group`): the tokens are host data
at both ends (a source's documents, the step driver's sequences), and the pairs of ranks that
exchange change every step. On the job's NCCL communicator each new pair would make NCCL set up
a connection (about 0.23 GB of device memory on an HGX node) at an unpredictable step, beside
two copies through the device and their host syncs.

A rank's batch then holds its own tasks' documents and ``None`` for the rest (the step driver
reads only its own tasks' sequences; the plan check compares digests of the plan, and a rank
without the whole batch has no opinion on the batch's). Before this a 1,024-rank job received
every token of the batch on every rank each step, pickled and padded to the largest part.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from megatron_dcp.plan.plan import Plan


def host_group() -> Any:
    """Collective (every rank of the job, once): the group the batch's lengths and tokens travel
    on: the default group where it is gloo, else a new gloo group over the job (module doc)."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend()).lower():
        return None
    return dist.new_group(backend="gloo")


def gather_lengths(mine: Optional[tuple[int, list[np.ndarray], str]],
                   dp_rank: int, group: Any = None
                   ) -> tuple[list[int], list[tuple[int, int]], list[int], str]:
    """Collective (``group``: a host group over the job, `host_group`): every source's document
    lengths. ``mine``: this rank's
    ``(dp_rank, documents, problem)`` if it is a source, else None. Returns the batch's lengths
    in data-parallel rank order, each document's ``(source global rank, index there)``, every
    global rank's data-parallel rank, and the first problem a source reported ("" for none)."""
    import torch.distributed as dist

    said = (dp_rank, None if mine is None else (mine[0], [len(d) for d in mine[1]], mine[2]))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, said, group=group)
    dp_of = [g[0] for g in gathered]
    sources = sorted((g[1][0], rank, g[1][1], g[1][2]) for rank, g in enumerate(gathered)
                     if g[1] is not None)
    lengths, where = [], []
    for _, rank, sizes, _ in sources:
        for i, n in enumerate(sizes):
            lengths.append(int(n))
            where.append((rank, i))
    problem = next((p for *_, p in sources if p), "")
    return lengths, where, dp_of, problem


def needed_by(plan: Plan, dp_of: Sequence[int]) -> list[list[int]]:
    """For each document of ``plan``, the global ranks that need its tokens: those whose
    data-parallel rank is among the ranks of a task holding it."""
    ranks_of: dict[int, list[int]] = {}  # data-parallel rank -> its global ranks
    for g, d in enumerate(dp_of):
        ranks_of.setdefault(d, []).append(g)
    dp_ranks: list[set[int]] = [set() for _ in plan.lengths]
    for task in plan.tasks:
        for s in task.seqs:
            dp_ranks[s].update(task.ranks)
    return [sorted(g for d in wanted for g in ranks_of.get(d, ())) for wanted in dp_ranks]


def exchange(local: list[np.ndarray], where: Sequence[tuple[int, int]],
             lengths: Sequence[int], needs: Sequence[Sequence[int]],
             group: Any = None) -> list[Optional[torch.Tensor]]:
    """Collective (``group``: a host group over the job, `host_group`, whose ranks are the
    job's): one ``all_to_all_single`` that gives this rank the tokens of every document it
    needs (host int64 tensors) and ``None`` for the others. ``lengths``: the plan's (a
    document the oversize policy truncated travels as its first ``lengths[s]`` tokens, the
    prefix the step trains: `megatron_dcp.runtime.truncate`)."""
    import torch.distributed as dist

    world, me = dist.get_world_size(group), dist.get_rank(group)
    send: list[list[int]] = [[] for _ in range(world)]  # documents this rank sends to each rank
    receive: list[list[int]] = [[] for _ in range(world)]  # documents it gets from each rank
    for s, ((source, _), ranks) in enumerate(zip(where, needs)):
        for g in ranks:
            if source == me:
                send[g].append(s)
            if g == me:
                receive[source].append(s)
    parts = [torch.from_numpy(np.asarray(local[where[s][1]][:lengths[s]], dtype=np.int64))
             for g in range(world) for s in send[g]]
    out_sizes = [sum(lengths[s] for s in docs) for docs in receive]
    inputs = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    got = torch.empty(sum(out_sizes), dtype=torch.int64)
    dist.all_to_all_single(got, inputs, output_split_sizes=out_sizes,
                           input_split_sizes=[sum(lengths[s] for s in docs) for docs in send],
                           group=group)
    sequences: list[Optional[torch.Tensor]] = [None] * len(lengths)
    offset = 0
    for docs in receive:
        for s in docs:
            sequences[s] = got[offset:offset + lengths[s]]
            offset += lengths[s]
    return sequences


def global_batch(local: Optional[list[np.ndarray]], dp_rank: int, problem: str,
                 plan_of: Callable[[list[int]], Plan],
                 group: Any = None) -> tuple[list[Optional[torch.Tensor]], Plan]:
    """This rank's view of the step's global batch and its plan (module doc). ``local``: this
    rank's documents if it is a source (else None); ``problem``: why a source refuses its
    documents ("" for none): raised on every rank alike, before any plan; ``group``: the host
    group over the job (`host_group`)."""
    lengths, where, dp_of, first = gather_lengths(
        None if local is None else (dp_rank, local, problem), dp_rank, group)
    if first:
        raise ValueError(first)
    plan = plan_of(lengths)
    sequences = exchange(local or [], where, plan.lengths, needed_by(plan, dp_of), group)
    return sequences, plan


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
