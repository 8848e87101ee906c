"""Activation offload: the inputs a recomputed layer keeps for backward wait in host memory.

A recomputed layer (`megatron_dcp.runtime.recompute.run_layer`) keeps only its input between
forward and backward, but a long task at a low degree keeps one such ``[tokens, hidden]`` input
per layer: 32 layers x 500K tokens x 4096 x 2 B = 131 GB for Llama-8B on one GPU. With
``Task.offload_layers = k`` the first ``k`` recomputed layers move their input to host memory in
forward and bring it back in backward, when their recompute needs it.

`offloaded_layer(fn, x, *args, stash=)` is ``torch.utils.checkpoint`` (non-reentrant) of
``fn(x, *args)`` whose ``x`` goes through a `HostStash` instead of being held by the checkpoint:
forward runs ``fn`` on the device tensor (autograd records the graph to ``x`` as usual, the
checkpoint's hooks keep no activations), the stash keeps a host copy, and the device tensor is
freed when the caller drops it; the recompute in backward reads the host copy back, with
``x``'s ``requires_grad``, so it saves the same tensors as the first forward.

On CUDA the copies run on a side stream: forward's copy to pinned host memory overlaps the next
layer (the device tensor's memory is not reused before its copy ends: ``record_stream``);
backward's copy of layer ``i`` starts when layer ``i + 1``'s recompute asks for its own input,
so it overlaps that layer's recompute and backward (a prefetch), and the compute stream waits
on an event only where the data is used. On the CPU (tests, and the measurement in
benchmarks/bench_long_sequence.py) the copy is synchronous; ``store="file"`` keeps the host
copies in an unlinked temporary file instead of the process's memory, so that the process's
resident memory shows what a device would hold.

One `HostStash` belongs to one forward of one task (the model makes it from the task it was
called with): no process-wide state but the one high-priority copy stream per device
(`offload_stream`) and its pool of host buffers (`HostPool`), and a backward on another thread
(CUDA's autograd worker)
finds everything through the checkpoint's saved function and arguments. Values are copied, not
changed: an offloaded layer trains bitwise as the same layer recomputed without offload.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint

from megatron_dcp.runtime.context import TaskContext

__all__ = ["HostPool", "HostStash", "OffloadEntry", "host_pool", "offload_layers_of",
           "offload_stream", "offloaded_layer", "stash_for"]


def offload_layers_of(task: Optional[TaskContext]) -> int:
    """Layers whose saved input goes to the host in ``task`` (0 outside a task); at most the
    task's recomputed layers."""
    if task is None:
        return 0
    return max(0, min(int(task.offload_layers), int(task.recompute_layers)))


def stash_for(task: Optional[TaskContext], store: str = "memory") -> Optional["HostStash"]:
    """A fresh `HostStash` for one forward of ``task``, or ``None`` when it offloads nothing."""
    return HostStash(store) if offload_layers_of(task) > 0 else None


_STREAMS: dict = {}
"""The offload stream of each CUDA device (`offload_stream`)."""


def offload_stream(device: torch.device) -> Any:
    """The one offload copy stream of ``device``, made at its first use with high priority
    (torch's default-priority streams come from the pool NCCL's streams also draw from, where a
    gigabyte copy could queue behind a collective)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _STREAMS[index]


POOL_GRAIN = 2 << 20
"""Host buffers are sized to a multiple of this many bytes. (Pinned ones come from torch's
caching host allocator, which still rounds each block up to a power of two.)"""


class HostPool:
    """Host buffers for the offloaded layer inputs of one device, reused from step to step:
    pinned on CUDA (allocated in the first steps, then reused, not asked of the allocator on
    every forward's path), ordinary memory elsewhere. A buffer comes back when its entry has been loaded; a later copy into it
    is issued on the same offload stream as that load (`offload_stream`), so it runs after it:
    no event is needed. The pool holds at most the most bytes its stashes had in use at once
    (``peak_bytes``: with pipeline parallelism several micro-steps' stashes): a new buffer that
    would take it past that first frees free buffers that did not fit, the smallest first."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._lock = threading.RLock()  # a stash dropped by the garbage collector gives back
        self._free: list[torch.Tensor] = []
        self.held_bytes = 0
        """Bytes of every buffer the pool owns, in use or free."""
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0
        """Buffers allocated so far (a step that reuses the pool's buffers adds none)."""

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` buffer of at least ``nbytes``: the smallest free one that is not much
        larger (a quarter or one grain), else a new one of ``nbytes`` rounded up to a grain."""
        slack = max(POOL_GRAIN, nbytes // 4)
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= nbytes + slack]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            else:
                size = -(-max(nbytes, 1) // POOL_GRAIN) * POOL_GRAIN
                limit = max(self.peak_bytes, self.in_use_bytes + size)
                while self._free and self.held_bytes + size > limit:  # the smallest go first
                    smallest = min(range(len(self._free)), key=lambda i: self._free[i].numel())
                    self.held_bytes -= self._free.pop(smallest).numel()
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
                self.held_bytes += size
                self.allocations += 1
            self.in_use_bytes += buf.numel()
            self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` (from `take`) is free again."""
        with self._lock:
            self.in_use_bytes -= buf.numel()
            self._free.append(buf)


_POOLS: dict = {}
"""The host pool of each device (`host_pool`)."""


def host_pool(device: torch.device) -> HostPool:
    """The one `HostPool` of ``device`` (pinned for a CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _POOLS:
        _POOLS[device] = HostPool(pinned=device.type == "cuda")
    return _POOLS[device]


class _Entry:
    """One offloaded tensor: its host copy and, while in flight or loaded, its device copy."""

    __slots__ = ("stash", "index", "device", "dtype", "shape", "requires_grad", "host", "offset",
                 "event", "loaded", "original", "buffer")

    def __init__(self, stash: "HostStash", index: int, x: torch.Tensor) -> None:
        self.stash, self.index = stash, index
        self.device, self.dtype, self.shape = x.device, x.dtype, tuple(x.shape)
        self.requires_grad = x.requires_grad
        self.host: Any = None
        self.buffer: Optional[torch.Tensor] = None  # the pool's buffer ``host`` is a view of
        self.offset = -1
        self.event: Any = None
        self.loaded: Optional[torch.Tensor] = None
        self.original: Optional[torch.Tensor] = x  # the forward's own tensor, until it ran

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


OffloadEntry = _Entry
"""What `HostStash.put` returns: a stashed tensor, for `HostStash.get` (engines that keep a
layer input through their own recompute's saved tensors: `megatron_dcp.megatron.spec`)."""


class HostStash:
    """The host copies of the offloaded layer inputs of one forward of one task.

    ``store``: ``"memory"`` (pinned host memory on CUDA, ordinary memory on the CPU) or
    ``"file"`` (CPU only: an unlinked temporary file, so resident memory counts device memory
    only). ``host_bytes``: bytes held now; ``peak_host_bytes``: the most held at once;
    ``copied_bytes``: bytes copied both ways (the traffic the planner times at the host link).
    """

    def __init__(self, store: str = "memory") -> None:
        if store not in ("memory", "file"):
            raise ValueError(f"HostStash: store must be 'memory' or 'file', got {store!r}")
        self.store = store
        self.entries: list[_Entry] = []
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.copied_bytes = 0
        self._stream: Any = None
        self._file: Any = None

    def __del__(self) -> None:
        # entries never loaded (a forward without backward) give their buffers back; a copy
        # still in flight into one is on the offload stream, before any later copy into it
        for entry in getattr(self, "entries", ()):
            if entry.buffer is not None:
                host_pool(entry.device).give(entry.buffer)
                entry.buffer = None

    # ------------------------------------------------------------------ streams
    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = offload_stream(device)
        return self._stream

    # ------------------------------------------------------------------ forward
    def put(self, x: torch.Tensor) -> _Entry:
        """Copy ``x`` to the host (asynchronously on CUDA); the entry keeps ``x`` until the
        layer's forward has run (`release`)."""
        entry = _Entry(self, len(self.entries), x)
        self.entries.append(entry)
        data = x.detach()
        if x.is_cuda:
            stream = self._side_stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                entry.host = self._pooled(entry)
                entry.host.copy_(data, non_blocking=True)
                entry.event = torch.cuda.Event()
                entry.event.record(stream)
            data.record_stream(stream)  # not reused before the copy ends
        elif self.store == "file":
            if self._file is None:
                self._file = tempfile.TemporaryFile(dir=os.environ.get("TMPDIR"))
            self._file.seek(0, os.SEEK_END)
            entry.offset = self._file.tell()
            self._file.write(data.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
                             if data.numel() else b"")
        else:
            entry.host = self._host_copy(entry, data)
        self.host_bytes += entry.nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.copied_bytes += entry.nbytes
        return entry

    def _pooled(self, entry: _Entry) -> torch.Tensor:
        """A host tensor of ``entry``'s shape and dtype in a buffer of its device's pool."""
        entry.buffer = host_pool(entry.device).take(entry.nbytes)
        return entry.buffer[:entry.nbytes].view(entry.dtype).view(entry.shape)

    def _host_copy(self, entry: _Entry, data: torch.Tensor) -> torch.Tensor:
        """The kept copy of a tensor not on CUDA (the CPU's "host" copy, in the pool)."""
        return self._pooled(entry).copy_(data)

    # ------------------------------------------------------------------ backward
    def _start_load(self, entry: _Entry) -> None:
        """Begin bringing ``entry`` back to its device (on the side stream on CUDA)."""
        if entry.loaded is not None or entry.original is not None:
            return
        if entry.device.type == "cuda":
            stream = self._side_stream(entry.device)
            if entry.event is not None:
                stream.wait_event(entry.event)  # its offload copy has ended
            with torch.cuda.stream(stream):
                entry.loaded = entry.host.to(entry.device, non_blocking=True)
                entry.event = torch.cuda.Event()
                entry.event.record(stream)
        elif self.store == "file":
            self._file.seek(entry.offset)
            raw = self._file.read(entry.nbytes)
            flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
                torch.empty(0, dtype=torch.uint8)
            entry.loaded = flat.view(entry.dtype).reshape(entry.shape).to(entry.device)
        else:
            entry.loaded = entry.host.to(entry.device, copy=True)
        self.copied_bytes += entry.nbytes

    def get(self, entry: _Entry) -> torch.Tensor:
        """The entry's tensor: the forward's own one during forward, else the host copy back on
        the device (its ``requires_grad`` as in forward), and the previous entry's prefetch
        started (backward recomputes layers in reverse order)."""
        if entry.original is not None:
            return entry.original
        self._start_load(entry)
        if entry.index > 0:
            self._start_load(self.entries[entry.index - 1])
        x = entry.loaded
        if x.is_cuda and entry.event is not None:
            torch.cuda.current_stream(x.device).wait_event(entry.event)
            x.record_stream(torch.cuda.current_stream(x.device))
        entry.loaded = None  # the recompute owns it now: freed after the layer's backward
        self._drop_host(entry)
        return x.detach().requires_grad_(entry.requires_grad)

    def release(self, entry: _Entry) -> None:
        """The layer's forward has run: forget the device tensor (only the host copy remains)."""
        entry.original = None

    def _drop_host(self, entry: _Entry) -> None:
        if entry.host is not None or entry.offset >= 0:
            entry.host = None
            entry.offset = -1
            self.host_bytes -= entry.nbytes
        if entry.buffer is not None:  # its load is issued: a later copy into it runs after
            host_pool(entry.device).give(entry.buffer)
            entry.buffer = None


class _FromHost:
    """The checkpointed function: reads the layer input from the stash, then runs the layer."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, entry: _Entry, *args: Any) -> torch.Tensor:
        x = entry.stash.get(entry)
        out = self.fn(x, *args)
        entry.stash.release(entry)
        return out


def offloaded_layer(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any,
                    stash: HostStash) -> torch.Tensor:
    """``fn(x, *args)`` recomputed in backward (non-reentrant checkpoint) with ``x`` kept in
    ``stash`` (host memory) instead of on the device between forward and backward."""
    if not torch.is_grad_enabled():
        return fn(x, *args)
    entry = stash.put(x)
    return torch.utils.checkpoint.checkpoint(_FromHost(fn), entry, *args, use_reentrant=False)
