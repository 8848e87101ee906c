"""`GroupPool`: the process groups of the DCP world, created collectively and looked up by ranks.

A plan uses, per task, the task's group and (for hybrid layouts) its Ulysses and ring sub-groups
(`megatron_dcp.plan.plan` documents the layout convention). Process groups must be created by
every member in the same order, so ``ensure(plan)`` is collective over the DCP world: every rank
computes the same sorted list of groups the plan needs and the pool lacks, and creates them in
that order. Groups are cached by their rank tuple (in group order: position = group-local rank),
so after the first steps an ``ensure`` creates nothing. ``ensure_all(vocabulary)`` creates a
bounded vocabulary up front, which is what large jobs should do: every NCCL communicator costs
creation time and device memory, and ``len(pool)`` / ``pool.report()`` say how many exist.

Ranks here are DCP-world ranks (``0 .. world_size - 1``, what plans use). When the DCP world is
a subset of the job (tensor or pipeline parallelism), pass ``world_ranks`` (this world's global
ranks; the pool then learns the other worlds with one all-gather, so every job rank must build
its pool at the same point) or ``all_worlds`` (every DCP world of the job). Every job rank then
creates each group for every world, in the same order (torch names a group by the count of
groups a process belongs to, so creating groups with local synchronisation only among members
breaks once members have different histories).
The backend is the default process group's (gloo on CPU, NCCL on CUDA) unless given.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from datetime import timedelta
from typing import Any, Iterable, Optional, Sequence

import torch.distributed as dist

from megatron_dcp.plan.plan import Plan, Task
from megatron_dcp.runtime.context import TaskContext

DEFAULT_GROUP_TIMEOUT = timedelta(seconds=120)

# torch >= 2.6 can keep the rank order of a group; older versions sort it.
_HAS_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters


def groups_of_task(task: Task) -> list[tuple[int, ...]]:
    """Every multi-rank group ``task`` uses: its own group, its Ulysses and ring sub-groups."""
    needed: set[tuple[int, ...]] = set()
    if task.degree > 1:
        needed.add(tuple(task.ranks))
    for g in range(task.degree):
        for sub in (task.ulysses_group(g), task.ring_group(g)):
            if len(sub) > 1:
                needed.add(tuple(sub))
    return sorted(needed)


def groups_of_plan(plan: Plan) -> list[tuple[int, ...]]:
    """Every multi-rank group of ``plan``, in a canonical order (size, then ranks)."""
    needed: set[tuple[int, ...]] = set()
    for task in plan.tasks:
        needed.update(groups_of_task(task))
    return sorted(needed, key=lambda r: (len(r), r))


class GroupPool:
    """Process groups of one DCP world, keyed by DCP-rank tuples in group order."""

    def __init__(self, world_ranks: Optional[Sequence[int]] = None, *,
                 all_worlds: Optional[Sequence[Sequence[int]]] = None,
                 timeout: timedelta = DEFAULT_GROUP_TIMEOUT, backend: Optional[str] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GroupPool needs torch.distributed to be initialised "
                               "(call dist.init_process_group first)")
        job_world, global_rank = dist.get_world_size(), dist.get_rank()
        if all_worlds is None:
            world = tuple(world_ranks) if world_ranks is not None else tuple(range(job_world))
            if sorted(world) == list(range(job_world)):
                all_worlds = [world]
            else:
                # Learn the other DCP worlds of the job (collective: every job rank builds its
                # pool at the same point, as Megatron's data-parallel groups are built).
                gathered: list[Any] = [None] * job_world
                dist.all_gather_object(gathered, world)
                all_worlds = sorted({tuple(w) for w in gathered}, key=min)
        worlds = [tuple(int(r) for r in w) for w in all_worlds]
        flat = sorted(r for w in worlds for r in w)
        if flat != list(range(job_world)) or len({len(w) for w in worlds}) != 1:
            raise ValueError(f"GroupPool: all_worlds {worlds} must split the job's "
                             f"{job_world} ranks into disjoint DCP worlds of equal size")
        mine = [w for w in worlds if global_rank in w]
        if world_ranks is not None and tuple(world_ranks) != mine[0]:
            raise ValueError(f"GroupPool: world_ranks {tuple(world_ranks)} is not the DCP "
                             f"world of rank {global_rank} in all_worlds ({mine[0]})")
        world = mine[0]
        self.world_ranks = world
        """Global rank of every DCP rank of this process's DCP world."""
        self.all_worlds = worlds
        self.rank = world.index(global_rank)
        """This process's rank in the DCP world (the rank plans use)."""
        self.timeout = timeout
        self.backend = backend
        self._groups: dict[tuple[int, ...], Any] = {}
        self.creation_s = 0.0
        """Seconds spent creating groups so far."""
        everyone = tuple(range(len(world)))
        if len(worlds) == 1 and world == tuple(range(job_world)) and backend is None:
            self.world_group = dist.group.WORLD
        else:
            self.world_group = self._new_group(everyone)
        if len(everyone) > 1:
            # A task over the whole DCP world in rank order reuses this group.
            self._groups[everyone] = self.world_group

    @property
    def world_size(self) -> int:
        """Ranks in the DCP world."""
        return len(self.world_ranks)

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, ranks: Sequence[int]) -> bool:
        return tuple(ranks) in self._groups

    def _new_group(self, ranks: tuple[int, ...]) -> Any:
        """Create the group ``ranks`` of every DCP world (all job ranks call, same order);
        return this world's."""
        kwargs: dict[str, Any] = dict(timeout=self.timeout, backend=self.backend)
        if _HAS_SORT_RANKS:
            kwargs["sort_ranks"] = False
        mine = None
        for world in self.all_worlds:
            global_ranks = [world[r] for r in ranks]
            if not _HAS_SORT_RANKS and global_ranks != sorted(global_ranks):
                raise ValueError(f"group {ranks}: ranks not in increasing order need torch >= "
                                 "2.6 (new_group(sort_ranks=False)); this torch sorts them")
            group = dist.new_group(global_ranks, **kwargs)
            if world == self.world_ranks:
                mine = group
        return mine

    def ensure_groups(self, groups: Iterable[Sequence[int]]) -> int:
        """Create any of ``groups`` not in the pool; collective over the job. Returns the number
        created. With one DCP world every rank must pass the same groups (any order); with
        several, the union of what the worlds lack is created (one small extra collective)."""
        wanted = {tuple(int(r) for r in g) for g in groups}
        for ranks in wanted:
            if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.world_size for r in ranks):
                raise ValueError(f"group {ranks}: ranks must be distinct DCP ranks in "
                                 f"0..{self.world_size - 1}")
        missing = {g for g in wanted if len(g) > 1 and g not in self._groups}
        if len(self.all_worlds) > 1:
            missing = self._union_over_worlds(missing)
        t0 = time.perf_counter()
        for ranks in sorted(missing, key=lambda r: (len(r), r)):
            self._groups[ranks] = self._new_group(ranks)
        self.creation_s += time.perf_counter() - t0
        return len(missing)

    def _union_over_worlds(self, missing: set) -> set:
        """Groups some DCP world lacks (all worlds must create every group together)."""
        import torch

        count = torch.tensor([len(missing)], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            count = count.cuda()
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if int(count.item()) == 0:
            return set()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(missing))
        return {tuple(g) for part in gathered for g in part if tuple(g) not in self._groups}

    def ensure(self, plan: Plan) -> int:
        """Create the groups ``plan`` needs that the pool lacks (collective; same order on every
        rank). Returns the number created."""
        if plan.world_size != self.world_size:
            raise ValueError(f"plan is for a DCP world of {plan.world_size} ranks, this pool has "
                             f"{self.world_size}")
        return self.ensure_groups(groups_of_plan(plan))

    def ensure_all(self, vocabulary: Any) -> int:
        """Create a whole vocabulary of task groups (and their sub-groups for every Ulysses
        degree dividing their size) up front. Collective. Returns the number created.

        ``vocabulary``: rank tuples, or the planner's `megatron_dcp.plan.Vocabulary`."""
        if hasattr(vocabulary, "groups"):
            vocabulary = vocabulary.groups()
        groups: set[tuple[int, ...]] = set()
        for ranks in vocabulary:
            ranks = tuple(ranks)
            for u in range(1, len(ranks) + 1):
                if len(ranks) % u == 0:
                    task = Task(id=0, ranks=ranks, seqs=(), ulysses=u, ring=len(ranks) // u)
                    groups.update(groups_of_task(task))
        return self.ensure_groups(groups)

    def get(self, ranks: Sequence[int]) -> Any:
        """The process group of ``ranks`` (DCP ranks, group order); ``None`` for a single rank."""
        key = tuple(int(r) for r in ranks)
        if len(key) == 1:
            return None
        try:
            return self._groups[key]
        except KeyError:
            raise KeyError(f"no process group for ranks {key} in the pool ({len(self)} groups); "
                           "call pool.ensure(plan) on every rank first") from None

    def context_for(self, task: Task, rank: int, layout: Any = None) -> TaskContext:
        """The `TaskContext` of DCP rank ``rank`` running ``task`` with shard ``layout``."""
        if rank not in task.ranks:
            raise ValueError(f"rank {rank} is not in task {task.id} (ranks {task.ranks})")
        g = task.ranks.index(rank)
        # The context names ranks globally: the Ulysses and ring communicators address peers by
        # global rank, while plans use DCP-world ranks (a subset of the job under tensor
        # parallelism). Group lookup above still uses the plan's ranks.
        global_task = task
        if self.world_ranks != tuple(range(len(self.world_ranks))):
            global_task = dataclasses.replace(
                task, ranks=tuple(self.world_ranks[r] for r in task.ranks))
        return TaskContext(
            task=global_task,
            group_rank=g,
            group=self.get(task.ranks),
            ulysses_group=self.get(task.ulysses_group(g)),
            ring_group=self.get(task.ring_group(g)),
            layout=layout,
            ckpt_layers=task.ckpt_layers,
        )

    def report(self) -> dict[str, Any]:
        """How many groups exist, by size, and the time spent creating them."""
        by_size: dict[int, int] = {}
        for ranks in self._groups:
            by_size[len(ranks)] = by_size.get(len(ranks), 0) + 1
        return {"groups": len(self), "by_size": dict(sorted(by_size.items())),
                "creation_s": round(self.creation_s, 4)}
