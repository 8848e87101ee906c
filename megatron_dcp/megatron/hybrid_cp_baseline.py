"""Megatron's own hybrid/dynamic context-parallel scheduler as a baseline `Plan`.

megatron-core ships ``BalancedCPScheduler`` (pipeline_parallel/hybrid_cp_schedule.py): every
sequence gets CP size ``next_pow2(length / max_seqlen_per_dp_cp_rank)``, work is estimated as
``length^2 / cp`` and sequences are grouped greedily into *groups* in which every DP x CP rank has
about the same work; Megatron runs the groups one after another with a barrier between them.
`hybrid_cp_plan` runs that real scheduler (it asks its ``dp_cp_group`` only for ``.size()``, so no
process group is needed) on a list of lengths and converts its output to our `Plan`:

* a sequence placed on CP ranks ``[a..b]`` of group ``w`` becomes a task on those ranks, one
  sequence, ring layout (Megatron's default ``p2p`` CP communication), no recompute;
* order: group by group; inside a group, by the sequence's first position in its ranks' lists;
* times (with a ``cost_model``): every task starts when all its ranks are free; every group starts
  when all ranks finished the previous one (Megatron's barrier). Without a cost model every task
  has ``start`` and ``duration`` 0: the task ids alone give the order (plans run in (start, id)
  order).

This is a stronger comparison than a re-implementation (the planner's ``greedy-cp`` policy), and
is evaluated by the same simulator and cost model as every other policy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from megatron_dcp.plan.plan import Plan, Task


class _SizeOnlyGroup:
    """Stands in for the DP x CP process group: the scheduler only calls ``.size()``."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        """Ranks of the stand-in group."""
        return self._size


def megatron_groups(lengths: Sequence[int], world_size: int,
                    max_seqlen_per_rank: int) -> list[list[list[int]]]:
    """Megatron's groups: for every group, for every rank, the sequence ids it processes."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    if world_size < 1 or max_seqlen_per_rank < 1:
        raise ValueError(f"world_size ({world_size}) and max_seqlen_per_rank "
                         f"({max_seqlen_per_rank}) must be positive")
    longest = max(lengths, default=0)
    if longest > max_seqlen_per_rank * world_size:
        raise ValueError(f"a sequence of {longest} tokens needs more than the {world_size} "
                         f"ranks at max_seqlen_per_dp_cp_rank={max_seqlen_per_rank}")
    scheduler = BalancedCPScheduler(max_seqlen_per_rank, _SizeOnlyGroup(world_size))
    _, sample_id_groups = scheduler.get_groups_and_subsamples(
        [(i, int(n)) for i, n in enumerate(lengths)], None)
    return [[list(ids) for ids in group] for group in sample_id_groups]


def hybrid_cp_plan(lengths: Sequence[int], world_size: int, max_seqlen_per_rank: int,
                   cost_model=None) -> Plan:
    """A `Plan` of Megatron's ``BalancedCPScheduler`` for ``lengths`` (see the module doc)."""
    groups = megatron_groups(lengths, world_size, max_seqlen_per_rank)
    drafts = []  # (group, first position, seq, ranks)
    for w, per_rank in enumerate(groups):
        placed: dict[int, list[tuple[int, int]]] = {}
        for rank, ids in enumerate(per_rank):
            for pos, seq in enumerate(ids):
                placed.setdefault(seq, []).append((rank, pos))
        for seq, where in placed.items():
            ranks = tuple(sorted(r for r, _ in where))
            drafts.append((w, min(p for _, p in where), seq, ranks))
    drafts.sort()
    seen = [d[2] for d in drafts]
    if sorted(seen) != list(range(len(lengths))):
        raise RuntimeError("Megatron's scheduler did not place every sequence exactly once: "
                           f"{sorted(seen)}")

    tasks = []
    clock = [0.0] * world_size
    current_group = 0
    for order, (w, _, seq, ranks) in enumerate(drafts):
        task = Task(id=order, ranks=ranks, seqs=(seq,), ulysses=1, ring=len(ranks))
        if cost_model is not None:
            if w != current_group:  # Megatron's barrier between groups
                clock = [max(clock)] * world_size
                current_group = w
            start = max(clock[r] for r in ranks)
            duration = float(cost_model.time_model.task_time(task, lengths))
            for r in ranks:
                clock[r] = start + duration
            task = replace(task, start=start, duration=duration)
        tasks.append(task)
    return Plan(tasks=tuple(tasks), lengths=tuple(int(n) for n in lengths),
                world_size=world_size, policy="megatron-hybrid-cp",
                meta={"groups": len(groups), "max_seqlen_per_dp_cp_rank": max_seqlen_per_rank,
                      "timed": cost_model is not None})
