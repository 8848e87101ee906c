"""The lengths-first input stage: a global batch without sending every token to every rank.

Each data-parallel source (a rank that holds part of the global batch: every rank under the
DeepSpeed plugin, the first pipeline stage's tensor-parallel rank 0 of each data-parallel rank
under the Megatron-LM launcher) holds its documents. Then, every step:

1. every rank learns every document's length and whether any source refused its documents
   (`dist.all_gather_object` of lengths only: a few bytes a document; `gather_lengths`);
2. every rank plans the batch from the lengths (``plan_of``: the step driver's ``plan``, the
   same plan everywhere: the driver checks it);
3. each document's tokens go, in one ``all_to_all_single`` over the job, only to the ranks
   whose data-parallel rank runs a task holding it (`needed_by`, `exchange`), never pickled.

Both collectives run on a host (gloo) group over the job (`host_group`): the tokens are host data
at both ends (a source's documents, the step driver's sequences), and the pairs of ranks that
exchange change every step. On the job's NCCL communicator each new pair would make NCCL set up
a connection (about 0.23 GB of device memory on an HGX node) at an unpredictable step, beside
two copies through the device and their host syncs.

A rank's batch then holds its own tasks' documents and ``None`` for the rest (the step driver
reads only its own tasks' sequences; the plan check compares digests of the plan, and a rank
without the whole batch has no opinion on the batch's). The batch is the sources' documents in
data-parallel rank order. Engine-neutral: the front ends say which ranks are sources and what
their data-parallel ranks are (`megatron_dcp.megatron.lm_data`, `deepspeed_plugin.engine`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from megatron_dcp.plan.plan import Plan

__all__ = ["Gathered", "StageBatch", "exchange", "gather_lengths", "global_batch", "host_group",
           "needed_by", "share_of"]


class Gathered(NamedTuple):
    """What `gather_lengths` learns: the batch's lengths in data-parallel rank order, each
    document's ``(source global rank, index there)``, every global rank's data-parallel rank,
    the first problem a source reported (``""``: none), and the next batch's lengths (the
    sources' ``next_lengths`` in the same order; ``None`` unless every source gave them)."""

    lengths: list[int]
    where: list[tuple[int, int]]
    dp_of: list[int]
    problem: str
    next_lengths: Optional[list[int]]


class StageBatch(NamedTuple):
    """This rank's view of a step's global batch (``None`` for the documents it does not
    need), the step's plan, and the next batch's lengths (`Gathered.next_lengths`)."""

    sequences: list[Optional[torch.Tensor]]
    plan: Plan
    next_lengths: Optional[list[int]]


def host_group() -> Any:
    """Collective (every rank of the job, once): the group the batch's lengths and tokens travel
    on: the default group where it is gloo, else a new gloo group over the job (module doc)."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend()).lower():
        return None
    return dist.new_group(backend="gloo")


def gather_lengths(mine: Optional[tuple[int, Sequence[Any], str]], dp_rank: int,
                   group: Any = None,
                   next_lengths: Optional[Sequence[int]] = None) -> Gathered:
    """Collective (``group``: a host group over the job, `host_group`): every source's document
    lengths. ``mine``: this rank's ``(dp_rank, documents, problem)`` if it is a source, else
    None (``documents``: anything with a ``len``); ``next_lengths``: a source's documents of
    the next step, gathered in the same collective (for a plan made ahead)."""
    import torch.distributed as dist

    said = (dp_rank, None if mine is None else
            (mine[0], [len(d) for d in mine[1]], mine[2],
             None if next_lengths is None else [int(n) for n in next_lengths]))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, said, group=group)
    dp_of = [g[0] for g in gathered]
    sources = sorted((g[1][0], rank, g[1][1], g[1][2], g[1][3])
                     for rank, g in enumerate(gathered) if g[1] is not None)
    lengths, where = [], []
    for _, rank, sizes, _, _ in sources:
        for i, n in enumerate(sizes):
            lengths.append(int(n))
            where.append((rank, i))
    problem = next((p for _, _, _, p, _ in sources if p), "")
    following = None
    if sources and all(s[4] is not None for s in sources):
        following = [n for s in sources for n in s[4]]
    return Gathered(lengths, where, dp_of, problem, following)


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


def exchange(local: Sequence[Any], where: Sequence[tuple[int, int]],
             lengths: Sequence[int], needs: Sequence[Sequence[int]],
             group: Any = None) -> list[Optional[torch.Tensor]]:
    """Collective (``group``: a host group over the job, `host_group`, whose ranks are the
    job's): one ``all_to_all_single`` that gives this rank the tokens of every document it
    needs (host int64 tensors) and ``None`` for the others. ``local``: this rank's documents
    (host arrays or tensors); ``lengths``: the plan's (a document the oversize policy truncated
    travels as its first ``lengths[s]`` tokens, the prefix the step trains:
    `megatron_dcp.runtime.truncate`)."""
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


def global_batch(local: Optional[Sequence[Any]], dp_rank: int, problem: str,
                 plan_of: Callable[[list[int]], Plan], group: Any = None, *,
                 next_lengths: Optional[Sequence[int]] = None) -> StageBatch:
    """This rank's view of the step's global batch, its plan and the next batch's lengths
    (module doc). ``local``: this rank's documents if it is a source (else None);
    ``problem``: why a source refuses its documents (``""`` for none): raised on every rank
    alike, before any plan; ``plan_of(lengths)``: the plan of the batch (the same on every
    rank); ``group``: the host group over the job (`host_group`); ``next_lengths``: a source's
    documents of the next step (`gather_lengths`)."""
    gathered = gather_lengths(None if local is None else (dp_rank, local, problem), dp_rank,
                              group, next_lengths)
    if gathered.problem:
        raise ValueError(gathered.problem)
    plan = plan_of(gathered.lengths)
    sequences = exchange(local or [], gathered.where, plan.lengths,
                         needed_by(plan, gathered.dp_of), group)
    return StageBatch(sequences, plan, gathered.next_lengths)


def share_of(count: int, rank: int, world_size: int) -> range:
    """The indices of rank ``rank``'s share of a global batch of ``count`` documents: contiguous
    and in rank order, sizes differing by at most one (``numpy.array_split``'s), so the shares
    concatenated in rank order are the batch (`gather_lengths` orders them so)."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))
