"""`GroupPool`: the process groups of the DCP world, created collectively and looked up by ranks.

A task uses its group and, for hybrid layouts, its Ulysses and ring sub-groups
(`megatron_dcp.plan.vocabulary.communicators`). Process groups must be created by every rank in
the same order (on NCCL each is a communicator split all ranks join), so creation is collective:
``create_all(vocabulary)`` at start-up creates every group a plan over that vocabulary can use, in
the vocabulary's fixed order, and warms each communicator once; afterwards ``ensure(plan)``
creates nothing for the planner's plans, and a group outside the vocabulary (a hand-written plan,
a baseline) is still created collectively inside the step, warmed, counted and reported. Groups are
cached by their rank tuple in group order (position = group-local rank).

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
import hashlib
import importlib
import inspect
import time
import warnings
from datetime import timedelta
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dcp.plan.plan import Plan, Task
from megatron_dcp.plan.vocabulary import (ALL_REDUCE, ALL_TO_ALL, SEND_RECV, Vocabulary,
                                          communicators)
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.liveness import stop_responder, wait_for_responders

DEFAULT_GROUP_TIMEOUT = timedelta(minutes=30)

# torch >= 2.6 can keep the rank order of a group; older versions sort it.
_HAS_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters


OUTSIDE_LIMIT = 8
"""`GroupPool`'s default bound on groups made inside steps, outside the start-up vocabulary (on
NCCL each is a communicator of about 0.5 GB that the planner's memory model does not count)."""


def before_init_process_group() -> None:
    """Call before ``init_process_group``: imports ``torch.distributed.nn`` while no world
    group exists.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated when the module is
    imported. Imported after the world group exists (``torch._dynamo`` imports it, and DeepSpeed
    imports that lazily), they hold the world group: ``destroy_process_group`` then cannot free
    it, and its backend's threads (gloo's) live on into interpreter finalization, where freeing
    them can abort the process ("terminate called without an active exception"). Nothing is
    imported once a world group exists (the import would then hold it).
    """
    if not (dist.is_available() and dist.is_initialized()):
        importlib.import_module("torch.distributed.nn")


def destroy_process_groups() -> None:
    """Destroy every process group of the job and free them now, while the interpreter is
    whole: the backend's threads end here, not during interpreter finalization.

    Through DeepSpeed's ``deepspeed.comm`` when it initialised the job (it then also drops its
    own references to the groups); a garbage collection frees groups that only reference cycles
    (a DeepSpeed engine and its module's hooks) still held. A DeepSpeed engine must be
    ``destroy()``-ed first: its ZeRO gradient hooks keep it, and its groups, alive. The liveness
    responder stops first, and rank 0 (the rendezvous store's host) waits for every rank's to
    stop, so none looks into the store after its host exited.
    """
    import gc
    import sys

    if dist.is_available() and dist.is_initialized():
        stop_responder()
        wait_for_responders()
        ds_comm = sys.modules.get("deepspeed.comm")
        if ds_comm is not None and ds_comm.is_initialized():
            ds_comm.destroy_process_group()
        else:
            dist.destroy_process_group()
    gc.collect()


def groups_of_task(task: Task) -> list[tuple[int, ...]]:
    """Every multi-rank group ``task`` uses: its own group, its Ulysses and ring sub-groups."""
    return sorted(communicators(task.ranks, task.ulysses))


def comm_device(group: Any = None) -> torch.device:
    """The job's device for a collective on ``group`` (default: the default group): the current
    CUDA device when the group runs NCCL (it refuses host tensors), else the host (gloo). Every
    tensor the runtime and the engines hand to a collective is made here, never on the host by
    default (gloo would take it; NCCL fails on it)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


EVERY_KIND = frozenset({ALL_REDUCE, ALL_TO_ALL, SEND_RECV})
"""What a group made outside the vocabulary is warmed with (its tasks are not known there)."""


def warm_group(group: Any, global_ranks: Sequence[int],
               kinds: Iterable[str] = EVERY_KIND) -> torch.Tensor:
    """Run once on ``group`` (members ``global_ranks`` in group order, this rank among them)
    each kind of collective its tasks run (`megatron_dcp.plan.vocabulary.operations`): an
    all-reduce, an all-to-all (Ulysses), a batched send to the next member and receive from the
    previous one (the ring's order and ops). NCCL sets connections up lazily, at their first
    use, for the collective that uses them; after this their memory is taken, so memory
    measured next counts it, and nothing is set up that no task uses.

    Returns, without reading it on the host, the values `warm_values` expects: the sum of ones
    (all-reduce), what each member sent (all-to-all), the previous member's index (ring).
    """
    device = comm_device(group)
    n, me = len(global_ranks), list(global_ranks).index(dist.get_rank())
    out = [torch.zeros(0, device=device)]
    if ALL_REDUCE in kinds:
        out.append(torch.ones(1, dtype=torch.float32, device=device))
        dist.all_reduce(out[-1], group=group)
    sent = torch.full((n,), float(me), dtype=torch.float32, device=device)
    if ALL_TO_ALL in kinds:
        out.append(torch.empty_like(sent))
        dist.all_to_all_single(out[-1], sent, group=group)
    if SEND_RECV in kinds:
        out.append(torch.empty(1, dtype=torch.float32, device=device))
        ops = [dist.P2POp(dist.isend, sent[:1].clone(), global_ranks[(me + 1) % n], group),
               dist.P2POp(dist.irecv, out[-1], global_ranks[(me - 1) % n], group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return torch.cat(out)


def warm_values(size: int, me: int, kinds: Iterable[str] = EVERY_KIND) -> list[float]:
    """What `warm_group` returns on member ``me`` of a group of ``size`` for ``kinds``."""
    return ([float(size)] if ALL_REDUCE in kinds else []) \
        + ([float(i) for i in range(size)] if ALL_TO_ALL in kinds else []) \
        + ([float((me - 1) % size)] if SEND_RECV in kinds else [])


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
                 timeout: timedelta = DEFAULT_GROUP_TIMEOUT, backend: Optional[str] = None,
                 outside_limit: int = OUTSIDE_LIMIT) -> None:
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
        self.vocabulary: Optional[Vocabulary] = None
        """The vocabulary `create_all` built the pool from (``None``: groups are created lazily)."""
        self.outside_vocabulary: list[tuple[int, ...]] = []
        """Groups created inside a step after `create_all`: the vocabulary lacked them."""
        self.outside_limit, self.freed = int(outside_limit), 0
        """The most such groups alive at once (beyond: LRU freed), and how many were freed."""
        self._outside_used: dict[tuple[int, ...], int] = {}  # group -> its last plan's number
        self._plans = 0
        self.startup: dict[str, Any] = {}
        """What `create_all` did: communicators, created, member_of, max_per_rank, seconds."""
        everyone = tuple(range(len(world)))
        if len(worlds) == 1 and world == tuple(range(job_world)) and backend is None:
            self.world_group = dist.group.WORLD
        else:
            self.world_group = self._new_group(everyone)
        if len(everyone) > 1:
            # A task over the whole DCP world in rank order reuses this group.
            self._groups[everyone] = self.world_group
        self.job_group = dist.group.WORLD
        """Every rank of every DCP world (the job): what must agree job-wide goes over it, as
        tensor-parallel peers in different DCP worlds run the same tasks (the plan check, the
        calibration's measured times, the starting hardware)."""

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
        """Create any of ``groups`` not in the pool; collective over the job when one is missing.
        Returns the number created.

        Every job rank must pass the same groups (any order): every rank of a DCP world runs the
        same plan (its digest is checked), and with several DCP worlds (tensor or pipeline
        parallelism) every world runs that same plan, which the model's own tensor- and
        pipeline-parallel communication needs anyway. Every job rank's pool holds the same rank
        tuples (groups are created for all worlds together), so each rank finds the same missing
        groups by itself: when none is missing, nothing is communicated. When some are, every
        job rank first checks that all found the same ones when the job has several DCP worlds
        (one all-reduce; a mismatch raises on every rank; one world's plans were compared by the
        plan check), then creates them in one order."""
        wanted = {tuple(int(r) for r in g) for g in groups}
        for ranks in wanted:
            if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.world_size for r in ranks):
                raise ValueError(f"group {ranks}: ranks must be distinct DCP ranks in "
                                 f"0..{self.world_size - 1}")
        order = sorted((g for g in wanted if len(g) > 1 and g not in self._groups),
                       key=lambda r: (len(r), r))
        if not order:
            return 0
        if len(self.all_worlds) > 1:
            self._check_same_everywhere(
                f"missing:{order}", "GroupPool.ensure_groups: the DCP worlds lack different "
                "groups (their plans differ); every DCP world of the job must run the same plan")
        t0 = time.perf_counter()
        for ranks in order:
            self._groups[ranks] = self._new_group(ranks)
        # warmed where they are made, as the start-up's are: NCCL would otherwise set each up
        # lazily inside the first task's collective, while the task's other communicators run
        self._warm([ranks for ranks in order if self.rank in ranks])
        self.creation_s += time.perf_counter() - t0
        if self.vocabulary is not None:
            self._outside_used.update({ranks: self._plans for ranks in order})
            self._free_unused(keep=wanted)
            if not self.outside_vocabulary:
                warnings.warn(f"GroupPool: {len(order)} process group(s) created inside the step, "
                              f"outside the start-up vocabulary (first: {order[0]}); on NCCL each "
                              "is a communicator split every rank joins", stacklevel=2)
            self.outside_vocabulary.extend(order)
        return len(order)

    def ensure(self, plan: Plan) -> int:
        """Create the groups ``plan`` needs that the pool lacks (collective; same order on every
        rank). Returns the number created."""
        if plan.world_size != self.world_size:
            raise ValueError(f"plan is for a DCP world of {plan.world_size} ranks, this pool has "
                             f"{self.world_size}")
        self._plans += 1
        needed = groups_of_plan(plan)
        for ranks in needed:
            if ranks in self._outside_used:
                self._outside_used[ranks] = self._plans
        return self.ensure_groups(needed)

    def _free_unused(self, keep: set) -> None:
        """Free the least recently used groups outside the vocabulary while more than
        `outside_limit` are alive, never one in ``keep`` (the plan's). Every rank of the job
        frees the same ones, in the same order: they follow from the plans, which are the same
        everywhere. A communicator is device memory the planner does not count."""
        while len(self._outside_used) > self.outside_limit:
            unused = [g for g in self._outside_used if g not in keep]
            if not unused:
                return
            ranks = min(unused, key=lambda g: (self._outside_used[g], len(g), g))
            del self._outside_used[ranks]
            group = self._groups.pop(ranks)
            if self.rank in ranks:  # a member's handle; others hold none to free
                dist.destroy_process_group(group)
            self.freed += 1

    def create_all(self, vocabulary: Vocabulary, *, warm: bool = True) -> str:
        """Start-up: create every communicator ``vocabulary`` can use (its task groups and the
        sub-groups of their allowed layouts, `Vocabulary.communicators`) in its fixed order, then
        warm each with the collectives its tasks run (`warm_group`, `Vocabulary.operations`), so
        the first step pays neither the creation nor the lazy set-up of per-peer buffers, memory
        measured after start-up counts them, and no buffers are set up that no task uses.
        Collective over the job: every job rank calls it with the same vocabulary (checked
        first: a mismatch raises on every rank instead of hanging). Returns a one-line report;
        the numbers are in ``self.startup``. Plans of `megatron_dcp.plan.make_plan` with the
        same settings (`Vocabulary.for_cost_model`) then create no group inside the step."""
        if vocabulary.world_size != self.world_size:
            raise ValueError(f"vocabulary is for a DCP world of {vocabulary.world_size} ranks, "
                             f"this pool has {self.world_size}")
        wanted = vocabulary.communicators()
        self._check_same_everywhere(f"{self.world_size}:{wanted}")
        t0 = time.perf_counter()
        created = 0
        for ranks in wanted:
            if ranks not in self._groups:
                self._groups[ranks] = self._new_group(ranks)
                created += 1
        t1 = time.perf_counter()
        self.creation_s += t1 - t0
        mine = [g for g in wanted if self.rank in g]
        if warm:
            self._warm(mine, vocabulary.operations())
        t2 = time.perf_counter()
        self.vocabulary = vocabulary
        self.startup = {"communicators": len(wanted), "created": created,
                        "member_of": len(mine), "max_per_rank": vocabulary.communicators_per_rank(),
                        "create_s": round(t1 - t0, 4), "warm_s": round(t2 - t1, 4)}
        return (f"group pool: {len(wanted)} communicators ({created} created), this rank in "
                f"{len(mine)}, at most {self.startup['max_per_rank']} per rank; "
                f"created in {t1 - t0:.2f} s, warmed in {t2 - t1:.2f} s")

    def _check_same_everywhere(self, key: str, error: Optional[str] = None) -> None:
        """Raise on every rank unless every job rank passed the same ``key`` (one all-reduce);
        ``error``: the message (default: the vocabularies differ)."""
        value = int(hashlib.sha256(key.encode()).hexdigest()[:15], 16)
        t = torch.tensor([value, -value], dtype=torch.int64, device=comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        low, high = t.tolist()
        if low != -high:
            raise RuntimeError(error or (
                "GroupPool.create_all: the ranks hold different vocabularies (world size, ranks "
                "per node, heads, attention layout, Ulysses scope and max degree must be equal "
                "on every rank)"))

    def _warm(self, mine: Sequence[tuple[int, ...]], kinds: Optional[dict] = None) -> None:
        """`warm_group` on each group in ``mine`` (same order on every member, so no two ranks
        wait on each other in opposite orders) with the collectives ``kinds`` gives it (a dict
        of group -> kinds, `Vocabulary.operations`; ``None``: every kind); checks the results
        once at the end."""
        kinds = kinds or {}
        kinds_of = [kinds.get(ranks, EVERY_KIND) for ranks in mine]
        results = [warm_group(self._groups[ranks], [self.world_ranks[r] for r in ranks], k)
                   for ranks, k in zip(mine, kinds_of)]
        got = torch.cat([t.cpu() for t in results]).tolist() if results else []
        bad = []
        for ranks, k in zip(mine, kinds_of):
            want = warm_values(len(ranks), ranks.index(self.rank), k)
            if got[:len(want)] != want:
                bad.append((ranks, got[:len(want)]))
            got = got[len(want):]
        if bad:
            raise RuntimeError(f"GroupPool: warm-up collectives gave wrong results (group; "
                               f"all-reduce sum, all-to-all, ring receive): {bad[:4]}")

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
            recompute_layers=task.recompute_layers,
        )

    def report(self) -> dict[str, Any]:
        """How many groups exist, by size, how many this rank is in, the time spent creating them,
        the start-up numbers and the groups created outside the start-up vocabulary."""
        by_size: dict[int, int] = {}
        for ranks in self._groups:
            by_size[len(ranks)] = by_size.get(len(ranks), 0) + 1
        return {"groups": len(self), "by_size": dict(sorted(by_size.items())),
                "member_of": sum(1 for g in self._groups if self.rank in g),
                "creation_s": round(self.creation_s, 4), "startup": dict(self.startup),
                "outside_vocabulary": len(self.outside_vocabulary), "freed": self.freed}
