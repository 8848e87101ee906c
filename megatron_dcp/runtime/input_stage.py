"""The lengths-first input stage: a global batch without sending every token to every rank.

Each data-parallel source (a rank that holds part of the global batch: every rank under the
DeepSpeed plugin, the first pipeline stage's tensor-parallel rank 0 of each data-parallel rank
under the Megatron-LM launcher) holds its documents. Then, every step:

1. every rank learns every document's length and whether any source refused its documents
   (`dist.all_gather_object` of lengths only: a few bytes a document; `gather_lengths`);
2. every rank plans the batch from the lengths (``plan_of``: the step driver's ``plan``, the
   same plan everywhere: the driver checks it);
3. each document's tokens go, in one ``all_to_all_single`` over the job, only to the ranks
   whose data-parallel rank runs a task holding it (`needed_by`, `exchange`), never pickled;
   where documents carry their own targets (a `WeightedBatch`: loss masks, weights, scales),
   their labels, weights and scales follow in a second exchange of the same shape
   (`exchange_targets`), and every rank learns every document's target figures (its sum of
   weights, its trained targets) with the lengths: the loss normalisation needs the whole
   batch's.

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
from megatron_dcp.runtime.targets import WeightedBatch

__all__ = ["Gathered", "StageBatch", "exchange", "exchange_targets", "gather_lengths",
           "global_batch", "host_group", "needed_by", "share_of"]


class Gathered(NamedTuple):
    """What `gather_lengths` learns: the batch's lengths in data-parallel rank order, each
    document's ``(source global rank, index there)``, every global rank's data-parallel rank,
    the first problem a source reported (``""``: none), the next batch's lengths (the
    sources' ``next_lengths`` in the same order; ``None`` unless every source gave them), and,
    where a source's documents carry their own targets (a `WeightedBatch`), every document's
    ``(sum of weights, targets of non-zero weight, has scales)`` and the batch's ``norm``
    (``targets`` None: no source's do)."""

    lengths: list[int]
    where: list[tuple[int, int]]
    dp_of: list[int]
    problem: str
    next_lengths: Optional[list[int]]
    targets: Optional[list[tuple[float, int, bool]]] = None
    norm: Optional[float] = None


class StageBatch(NamedTuple):
    """This rank's view of a step's global batch (``None`` for the documents it does not
    need), the step's plan, and the next batch's lengths (`Gathered.next_lengths`)."""

    sequences: Sequence[Optional[torch.Tensor]]
    """A `WeightedBatch` where a source's documents carry targets, else a list."""
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
    None (``documents``: anything with a ``len``; a `WeightedBatch`: its documents' target
    figures travel too); ``next_lengths``: a source's documents of the next step, gathered in
    the same collective (for a plan made ahead)."""
    import torch.distributed as dist

    said = (dp_rank, None if mine is None else
            (mine[0], [len(d) for d in mine[1]], mine[2],
             None if next_lengths is None else [int(n) for n in next_lengths],
             _target_figures(mine[1])))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, said, group=group)
    dp_of = [g[0] for g in gathered]
    sources = sorted((g[1][0], rank) + tuple(g[1][1:])
                     for rank, g in enumerate(gathered) if g[1] is not None)
    lengths, where = [], []
    for _, rank, sizes, _, _, _ in sources:
        for i, n in enumerate(sizes):
            lengths.append(int(n))
            where.append((rank, i))
    problem = next((s[3] for s in sources if s[3]), "")
    following = None
    if sources and all(s[4] is not None for s in sources):
        following = [n for s in sources for n in s[4]]
    targets, norm = None, None
    if any(s[5] is not None for s in sources):  # a source's documents carry their targets
        targets = [t for s in sources for t in (s[5][0] if s[5] is not None else
                                                [(float(max(n - 1, 0)), max(n - 1, 0), False)
                                                 for n in s[2]])]
        norm = next((s[5][1] for s in sources if s[5] is not None and s[5][1]), None)
    return Gathered(lengths, where, dp_of, problem, following, targets, norm)


def _target_figures(documents: Sequence[Any]) -> Optional[tuple[list, Optional[float]]]:
    """A `WeightedBatch`'s ``([(sum of weights, trained, has scales)], norm)``; None for plain
    documents."""
    if not isinstance(documents, WeightedBatch):
        return None
    return ([(w, n, documents.scales[i] is not None) for i, (w, n) in
             enumerate(documents.sums)], documents.norm)


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
             group: Any = None, columns: int = 0) -> list[Optional[torch.Tensor]]:
    """Collective (``group``: a host group over the job, `host_group`, whose ranks are the
    job's): one ``all_to_all_single`` that gives this rank the tokens of every document it
    needs (host int64 tensors) and ``None`` for the others. ``local``: this rank's documents
    (host arrays or tensors); ``lengths``: the plan's (a document the oversize policy truncated
    travels as its first ``lengths[s]`` tokens, the prefix the step trains:
    `megatron_dcp.runtime.truncate`). ``columns``: the documents are float64 ``[n, columns]``
    rows (`exchange_targets`), not token ids."""
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
    width = max(columns, 1)
    dtype = torch.float64 if columns else torch.int64
    parts = [torch.as_tensor(np.asarray(local[where[s][1]][:lengths[s]]),
                             dtype=dtype).reshape(-1) for g in range(world) for s in send[g]]
    out_sizes = [width * sum(lengths[s] for s in docs) for docs in receive]
    inputs = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
    got = torch.empty(sum(out_sizes), dtype=dtype)
    dist.all_to_all_single(got, inputs, output_split_sizes=out_sizes,
                           input_split_sizes=[width * sum(lengths[s] for s in docs)
                                              for docs in send], group=group)
    sequences: list[Optional[torch.Tensor]] = [None] * len(lengths)
    offset = 0
    for docs in receive:
        for s in docs:
            sequences[s] = got[offset:offset + width * lengths[s]]
            if columns:
                sequences[s] = sequences[s].view(lengths[s], columns)
            offset += width * lengths[s]
    return sequences


def global_batch(local: Optional[Sequence[Any]], dp_rank: int, problem: str,
                 plan_of: Callable[[list[int]], Plan], group: Any = None, *,
                 next_lengths: Optional[Sequence[int]] = None) -> StageBatch:
    """This rank's view of the step's global batch, its plan and the next batch's lengths
    (module doc). ``local``: this rank's documents if it is a source (else None; a
    `WeightedBatch` where they carry their own labels, weights or scales: the batch is then a
    `WeightedBatch` on every rank, holding the whole batch's target figures); ``problem``: why
    a source refuses its documents (``""`` for none): raised on every rank alike, before any
    plan; ``plan_of(lengths)``: the plan of the batch (the same on every rank); ``group``: the
    host group over the job (`host_group`); ``next_lengths``: a source's documents of the next
    step (`gather_lengths`)."""
    gathered = gather_lengths(None if local is None else (dp_rank, local, problem), dp_rank,
                              group, next_lengths)
    if gathered.problem:
        raise ValueError(gathered.problem)
    plan = plan_of(gathered.lengths)
    needs = needed_by(plan, gathered.dp_of)
    sequences = exchange(local or [], gathered.where, plan.lengths, needs, group)
    if gathered.targets is None:
        return StageBatch(sequences, plan, gathered.next_lengths)
    mine = local if isinstance(local, WeightedBatch) else WeightedBatch(local or [])
    has_scale = [t[2] for t in gathered.targets]
    columns = exchange_targets(mine, gathered.where, plan.lengths, needs, group,
                               scales=any(has_scale))
    sums = [(t[0], t[1]) for t in gathered.targets]
    if plan.truncated:  # the kept prefixes' figures, from their sources
        sums = _truncated_sums(mine, gathered.where, plan, sums, group)
    batch = WeightedBatch(sequences, [c if c is None else c[:, 0].long() for c in columns],
                          [c if c is None else c[:, 1] for c in columns],
                          [c[:, 2] if c is not None and scaled else None
                           for c, scaled in zip(columns, has_scale)],
                          sums=sums, norm=gathered.norm)
    return StageBatch(batch, plan, gathered.next_lengths)


def exchange_targets(local: WeightedBatch, where: Sequence[tuple[int, int]],
                     lengths: Sequence[int], needs: Sequence[Sequence[int]],
                     group: Any = None, scales: bool = True) -> list[Optional[torch.Tensor]]:
    """Collective, like `exchange`: each needed document's float64 rows (label, weight and,
    where the batch has any (``scales``: the same on every rank), scale: 1 where the document
    has none) from its source, ``None`` for the others. A label id travels exactly as a float64
    (ids are far below 2^53)."""
    columns = []
    for i, seq in enumerate(local):
        parts = [local.labels[i].to(torch.float64), local.weights[i]]
        if scales:
            parts.append(local.scales[i] if local.scales[i] is not None else
                         torch.ones(int(seq.shape[0]), dtype=torch.float64))
        columns.append(torch.stack(parts, dim=1))
    return exchange(columns, where, lengths, needs, group, columns=2 + int(scales))


def _truncated_sums(local: WeightedBatch, where: Sequence[tuple[int, int]], plan: Plan,
                    sums: list[tuple[float, int]], group: Any) -> list[tuple[float, int]]:
    """Collective: ``sums`` with each truncated document's figures those of its kept prefix
    (its source computes them; one small gather)."""
    import torch.distributed as dist

    me = dist.get_rank(group)
    mine = {}
    for s in plan.truncated:
        source, i = where[s]
        if source == me:
            kept = local.weights[i][:plan.lengths[s]]
            mine[s] = (float(kept.sum()), int((kept != 0).sum()))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    out = list(sums)
    for part in gathered:
        for s, figures in part.items():
            out[int(s)] = figures
    return out


def share_of(count: int, rank: int, world_size: int) -> range:
    """The indices of rank ``rank``'s share of a global batch of ``count`` documents: contiguous
    and in rank order, sizes differing by at most one (``numpy.array_split``'s), so the shares
    concatenated in rank order are the batch (`gather_lengths` orders them so)."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))
