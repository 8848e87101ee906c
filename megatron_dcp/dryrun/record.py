"""A rank of a real-size job on a CPU: torch's fake process group, the meta device as the job's
GPU, every collective and P2P call recorded, and host reads of device values counted.

* `FakeJob` (a context): the default process group is torch's fake backend (``cpu:fake,
  meta:fake``: it takes every collective and moves no data) with the job's world size and this
  rank; `megatron_dcp.runtime.groups.comm_device` answers ``meta`` (the job's device) and the
  attention kernels take torch's flash kernel, whose meta implementation has flash's shapes.
* `Recorder` (a dispatch mode): every ``c10d`` operation, whoever calls it, with its group's
  global ranks, the tensors' shapes, dtype and device and the peer of a send or receive. A tensor
  not on the job's device is an error at the call, as NCCL refuses a host tensor (gloo, on which
  every other test runs, takes it). Object collectives (``all_gather_object`` ...) carry pickles
  through host tensors by design: they are recorded as data movement, with their bytes.
* `HostReads` (a function mode): ``.item()``, ``.tolist()``, ``float``/``int``/``bool`` of a
  tensor, ``nonzero`` and copies to the host (``.cpu()``, ``.to("cpu")``) on the job's device
  (host syncs on a GPU) counted by call site, each answered with a placeholder (zeros,
  ``False``, no rows) so that the rank goes on.
* `check_consistency`: in every group, every member issued the same sequence of collectives
  (operation, shapes, dtype); every send has its receive, in order. A mismatch names the group,
  the first diverging call, the ranks and what each was running (task and micro-step).

Training never imports this package: the dry run gives the runtime a device and a process
group, nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import traceback
from collections import Counter
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

JOB_DEVICE = torch.device("meta")
"""The job's device in a dry run (it stands for the GPU)."""

P2P_OPS = {"send", "recv_", "recv_any_source_"}
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list",
                      "scatter_object_list")


class DeviceError(RuntimeError):
    """A tensor not on the job's device reached a collective (NCCL would refuse it)."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective or P2P call of one rank."""

    op: str
    group: tuple[int, ...]
    """Global ranks of the group, in group order."""
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    peer: Optional[int] = None
    """The other global rank of a send or a receive."""
    where: str = ""
    """What the rank was running (task and micro-step), for the report."""
    split: bool = False
    """An all-to-all given split sizes (MoE token dispatch): its rows are routing data."""

    def signature(self) -> tuple:
        """What every member of the group must agree on: operation, shapes and dtype; of an
        all-to-all with split sizes the row width, not the rows (each member sends its own
        tokens' routed copies)."""
        shapes = tuple(s[1:] for s in self.shapes) if self.split else self.shapes
        return (self.op, shapes, self.dtype)


def _group_ranks(obj: Any) -> tuple[int, ...]:
    """The global ranks of a process group handed to a ``c10d`` operation."""
    group = obj
    if isinstance(obj, torch.ScriptObject):
        group = torch._C._distributed_c10d.ProcessGroup.unbox(obj)
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group torch does not track: the default one
        return tuple(range(dist.get_world_size()))


def _tensors(args: Any) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += _tensors(a)
    return out


class Recorder(TorchDispatchMode):
    """Every ``c10d`` operation of this rank (module doc). ``where`` is set by the caller to what
    the rank runs now (`FakeJob` hooks the executor's micro-steps)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.calls: list[Call] = []
        self.object_bytes = 0
        """Bytes this rank received through object collectives (pickles: plan inputs, batches)."""
        self.where = "before the first task"
        self.in_object_collective = 0
        self.device_errors: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._record(func, args)
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple) -> None:
        name = func._opname if hasattr(func, "_opname") else str(func).split(".")[1]
        tensors = _tensors(args)
        group = next((_group_ranks(a) for a in args if isinstance(a, torch.ScriptObject)),
                     tuple(range(dist.get_world_size())))
        if self.in_object_collective:
            self.object_bytes += sum(t.numel() * t.element_size() for t in tensors
                                     if t.device.type != "meta")
        else:
            stray = [t for t in tensors if t.device != JOB_DEVICE]
            if stray:
                site = _call_site()
                text = (f"rank {self.rank}: c10d.{name} given a tensor on {stray[0].device} "
                        f"{tuple(stray[0].shape)} (the job's device is {JOB_DEVICE}: NCCL would "
                        f"refuse it) at {site}, while running {self.where}")
                self.device_errors.append(text)
                raise DeviceError(text)
        peer = None
        if name in P2P_OPS:
            local = next(a for a in args if isinstance(a, int))
            peer = group[local] if local < len(group) else local
        shapes = tuple(tuple(t.shape) for t in tensors)
        dtype = str(tensors[0].dtype) if tensors else ""
        split = name.startswith("alltoall_base") and any(
            isinstance(a, (list, tuple)) and a and isinstance(a[0], int) for a in args)
        self.calls.append(Call(name + ("[object]" if self.in_object_collective else ""), group,
                               shapes, dtype, peer, self.where, split))


def _call_site() -> str:
    """The innermost frame of the project's code on the stack."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "megatron_dcp" in frame.filename and "dryrun" not in frame.filename:
            return f"{frame.filename.split('megatron_dcp/')[-1]}:{frame.lineno}"
    return "?"


class HostReads(TorchFunctionMode):
    """Host reads of job-device values (module doc), counted by call site."""

    ANSWERS = {torch.Tensor.item: 0, torch.Tensor.__bool__: False, torch.Tensor.__float__: 0.0,
               torch.Tensor.__int__: 0, torch.Tensor.__index__: 0}
    LISTS = (torch.Tensor.tolist,)
    ROWS = (torch.Tensor.nonzero, torch.nonzero)
    COPIES = (torch.Tensor.cpu, torch.Tensor.numpy)

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and x.device == JOB_DEVICE and (
                func in self.ANSWERS or func in self.LISTS or func in self.ROWS
                or func in self.COPIES or _to_host(func, args, kwargs)):
            name = getattr(func, "__name__", str(func))
            self.sites[f"{_call_site()} {name}"] += 1
            if func in self.COPIES or func is torch.Tensor.to:
                zeros = torch.zeros(x.shape, dtype=x.dtype)
                return zeros.numpy() if func is torch.Tensor.numpy else zeros
            if func in self.ROWS:
                return torch.zeros((0, x.dim()), dtype=torch.long, device=JOB_DEVICE)
            if func in self.LISTS:
                return torch.zeros(x.shape, dtype=x.dtype).tolist()
            value = self.ANSWERS[func]
            return float(value) if x.is_floating_point() and func is torch.Tensor.item else value
        return func(*args, **kwargs)


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` is ``Tensor.to`` the host (a device-to-host copy)."""
    if func is not torch.Tensor.to:
        return False
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _object_collectives(recorder: Recorder) -> Iterator[None]:
    """``dist.*_object`` calls marked as data movement while they run."""
    with contextlib.ExitStack() as stack:
        for name in OBJECT_COLLECTIVES:
            own = getattr(dist, name)

            def marked(*args, __own=own, **kwargs):
                recorder.in_object_collective += 1
                try:
                    return __own(*args, **kwargs)
                finally:
                    recorder.in_object_collective -= 1

            stack.enter_context(_patched(dist, name, marked))
        yield


@contextlib.contextmanager
def _task_labels(recorder: Recorder) -> Iterator[None]:
    """What the rank runs, for the records: the executor's micro-steps."""
    from megatron_dcp.runtime import executor

    own = executor.PlanWork.running

    count = [0]

    @contextlib.contextmanager
    def running(work, step):
        task = step.task
        recorder.where = (f"task {task.id} (micro-step {count[0]})" if task is not None
                          else f"an empty micro-step ({count[0]})")
        count[0] += 1
        with own(work, step):
            yield
        recorder.where = "after the tasks"

    with _patched(executor.PlanWork, "running", running):
        yield


class FakeJob:
    """Rank ``rank`` of a ``world_size``-rank job on this process (module doc); ``with`` it,
    then run the rank's step inside `recording`."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.recorder = Recorder(rank)
        self.host_reads = HostReads()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "FakeJob":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from megatron_dcp.runtime import backends, groups, offload

        if dist.is_initialized():
            raise RuntimeError("a dry run needs a process without torch.distributed set up")
        dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=self.rank,
                                world_size=self.world_size)
        stack = self._stack
        stack.callback(_destroy)
        # every rank as in a process of its own (a rank in --jobs' worker, or after others in
        # this one, measures the same): the flash backward's per-device constants (16 bytes,
        # made at a process's first backward) are made again
        backends._device_state.cache_clear()
        job_device = lambda group=None: JOB_DEVICE  # noqa: E731
        own = groups.comm_device
        for module in [m for name, m in sys.modules.items() if name.startswith("megatron_dcp")]:
            if getattr(module, "comm_device", None) is own:
                stack.enter_context(_patched(module, "comm_device", job_device))
        # meta stands for a GPU: torch's flash kernel (its meta kernel has flash's shapes)
        own_supports = backends.backend_supports
        stack.enter_context(_patched(backends, "backend_supports", lambda name, device_type,
                                     *rest: own_supports(name, "cuda" if device_type == "meta"
                                                         else device_type, *rest)))
        # the warm-up's collectives run and are recorded; their values (no data moves) are not
        # checked
        stack.enter_context(_patched(groups.GroupPool, "_warm", lambda pool, mine, kinds=None: [
            groups.warm_group(pool._groups[r], [pool.world_ranks[i] for i in r],
                              (kinds or {}).get(r, groups.EVERY_KIND)) for r in mine]))
        # an offloaded layer input goes to the host, as from a GPU: a placeholder there (one
        # element seen at its shape: no memory), so the device keeps what a GPU would
        own_copy = offload.HostStash._host_copy
        stack.enter_context(_patched(offload.HostStash, "_host_copy", lambda stash, entry, data: (
            torch.empty((), dtype=data.dtype).expand(data.shape)
            if data.device == JOB_DEVICE else own_copy(stash, entry, data))))
        own_caps = backends.capabilities
        stack.enter_context(_patched(backends, "capabilities", lambda device: (
            backends.Capabilities(torch_flash=True) if device.type == "meta"
            else own_caps(device))))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the collectives and host reads of what runs inside."""
        from megatron_dcp.runtime.kernels import forced_backend

        with self.host_reads, self.recorder, _object_collectives(self.recorder), \
                _task_labels(self.recorder), forced_backend("torch_flash"):
            yield


def _destroy() -> None:
    from megatron_dcp.runtime.groups import destroy_process_groups

    destroy_process_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def check_consistency(calls: dict[int, list[Call]]) -> list[dict]:
    """The mismatches between ranks' call sequences ``calls`` (rank -> its calls), empty when
    every group's members issued the same collectives and every send met its receive."""
    mismatches: list[dict] = []
    by_group: dict[tuple[int, ...], dict[int, list[Call]]] = {}
    sends: dict[tuple[int, int], list[Call]] = {}
    recvs: dict[tuple[int, int], list[Call]] = {}
    for rank, mine in calls.items():
        for call in mine:
            if call.op in P2P_OPS:
                pair = (rank, call.peer) if call.op == "send" else (call.peer, rank)
                (sends if call.op == "send" else recvs).setdefault(pair, []).append(call)
            elif len(call.group) > 1:
                by_group.setdefault(call.group, {}).setdefault(rank, []).append(call)
    for group, members in sorted(by_group.items()):
        known = [r for r in group if r in calls]
        seqs = {r: members.get(r, []) for r in known}
        longest = max((len(s) for s in seqs.values()), default=0)
        for i in range(longest):
            got = {r: s[i] if i < len(s) else None for r, s in seqs.items()}
            if len({c.signature() if c else None for c in got.values()}) > 1:
                mismatches.append({
                    "group": list(group), "index": i,
                    "ranks": {str(r): (dataclasses.asdict(c) if c else "no call")
                              for r, c in got.items()}})
                break
    for pair in sorted(set(sends) | set(recvs)):
        if not all(r in calls for r in pair):
            continue
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for i in range(max(len(out), len(into))):
            a = out[i] if i < len(out) else None
            b = into[i] if i < len(into) else None
            if a is None or b is None or a.shapes != b.shapes or a.dtype != b.dtype:
                mismatches.append({"send": pair[0], "recv": pair[1], "index": i,
                                   "sent": dataclasses.asdict(a) if a else "no send",
                                   "received": dataclasses.asdict(b) if b else "no receive"})
                break
    return mismatches
