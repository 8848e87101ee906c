"""One-GPU check of DCP's kernels, runtime and integrations; prints and writes a JSON report.

    python tools/gpu_check.py --out runs/gpu_check.json                 # one GPU, < 8 min
    python tools/gpu_check.py --wheels wheels/ --out runs/gpu_check.json  # + carried wheels
    python tools/gpu_check.py --device cpu --out runs/gpu_check_cpu.json  # small, float32

It needs only torch; a section whose package (megatron-core, transformers, deepspeed) does not
import is skipped and names it, and the flash-attn backend is checked only where it imports.
``--wheels DIR`` first installs the wheels in DIR (``pip install --no-deps --no-index --target``,
or unpacked where pip is missing) on a machine without network. Every section has a time limit
(``SECTION_LIMIT_S``; an alarm ends it, a watchdog ends the script if a section hangs in C code)
and records its seconds; a failing section does not stop the others; the JSON is rewritten after
every section, so a killed run still leaves the numbers of the sections before. The summary says
PASS / FAIL / SKIP per section; the exit status is 1 if any section failed. On a terminal a
progress bar on stderr counts the sections and names the one running.

Sections:

* ``environment``: torch / CUDA / NCCL versions, the device, the optional packages, the
  attention backends per dtype and head dim.
* ``exactness``: every backend that runs on the device, on packed varlen GQA input, forward and
  backward, against the exact kernel in float64 on the CPU (same inputs), for every kernel dtype
  (bf16 and fp16 on CUDA) and head dim (64, 128, 256 on CUDA): causal, non-causal and video
  spatial/temporal groups at the main dtype and head dim, causal and non-causal at the others.
* ``ring``: ring degrees 2, 4, 8 and hybrid layouts simulated in one process (blocks merged as
  the ring does) against one full-sequence call of the same backend, per kernel dtype.
* ``throughput``: TFLOP/s of the ring-block path and of the local packed path against one flash
  varlen call on the same attention work (targets on CUDA: >= 0.7x and >= 0.9x).
* ``run_plan``: the reference decoder through `megatron_dcp.runtime.executor.run_plan` at world
  size 1 (NCCL on CUDA), recompute 0 and all layers, equal gradients, per kernel dtype.
* ``memory``: a planned one-sequence step of a decoder with a 32K vocabulary: peak CUDA memory
  (``torch.cuda.max_memory_allocated`` over the step's tasks, above the parameters and
  gradients) against the planner's `MemoryModel.task_memory` for its task (less its static
  part), the planned recomputed layers and all layers; passes within 10 % (CUDA only: on the CPU the
  prediction is reported, nothing is measured).
* ``long_sequences``: one long sequence as a one-rank task, every layer recomputed: MLP tiles,
  loss tiles, every layer offloaded (pinned host memory, side-stream copies on CUDA) and all
  three against recompute only: equal loss and gradients, step time (offload: exposed seconds
  and the share of its copy time compute hides, at the measured pinned-host bandwidth), peak
  CUDA memory against `MemoryModel.long_memory_of` (within 10 %; on the CPU predicted only).
* ``megatron``: a megatron-core GPTModel with DCP's layer spec through ``DCPForwardBackward``,
  recompute 0 vs all.
* ``hf``: tiny Llama (tied embeddings) and Qwen2 (q/k/v biases) from transformers configs through
  `megatron_dcp.integrations.hf.DCPCausalLM` and the step driver, loss and gradients against the
  same model with its own (SDPA) attention, one sequence at a time.
* ``deepspeed``: `deepspeed_plugin.initialize` at world size 1 (NCCL on CUDA), ZeRO-1 and
  ZeRO-3, two steps with DCP against two plain DeepSpeed steps: equal losses.
* ``calibration``: ``--dcp_hardware auto`` on the device and the online calibration over 8
  planned steps of the reference decoder: predicted vs measured step time, the fitted factors.
* ``profile``: the hardware profiler CLI writing ``runs/hardware_<device>.json`` (subprocess with
  a time limit).

Host syncs: ``run_plan``, ``megatron`` and ``hf`` run each step under the device's sync checker,
on only inside tasks (from a task's forward until its backward has ended); the plan check, the
driver's collective and the optimizer step stay
outside. A sync inside a task fails the section; the step then runs again unchecked so the
section still reports its numbers. On CUDA the checker is
``torch.cuda.set_sync_debug_mode("error")``; on the CPU a stand-in (`SyncCheck`) raises when a
floating-point tensor is read by the host (``item``, ``tolist``, ``float`` ...: the activations
and losses that live on the device on a GPU; the runtime's integer metadata is host-built by
design), so the same control flow runs in the tests. ``--inject-sync`` reads a logit on the host
inside every task: the negative control (those sections must fail).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import glob
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_dcp.progress import Progress  # noqa: E402
from megatron_dcp.runtime import backends, kernels  # noqa: E402
from megatron_dcp.runtime.layout import ShardLayout  # noqa: E402
from megatron_dcp.runtime.ring import ring_in_one_process  # noqa: E402
from megatron_dcp.runtime.step import StepEngine  # noqa: E402

# Sizes per device. exactness/ring: packed lengths, heads, kv heads, head dims (the first is the
# main one), video frame; throughput: one long sequence and a pack; model_*: the reference
# decoder of run_plan, megatron, deepspeed, calibration; mem_*: the memory section's decoder and
# its one sequence; ls_*: the long_sequences section's (tiles: MLP and loss tiles of its tiled
# cases); hf_*: the Hugging Face models.
SIZES = {
    "cuda": dict(lengths=(1000, 37, 513, 2048), heads=8, kv_heads=2, head_dims=(128, 64, 256),
                 frame=64, ring_lengths=(3000, 777, 8192),
                 ring_layouts=((1, 2), (1, 4), (1, 8), (2, 2), (2, 4)),
                 long=65536, long_heads=32, long_kv=8, pack=(64, 1024), model_hidden=1024,
                 model_layers=4, model_heads=16, model_kv=4, model_lengths=(3000, 900, 4096, 50),
                 mem_hidden=2048, mem_layers=4, mem_heads=16, mem_kv=4, mem_vocab=32000,
                 mem_tokens=16384, ls_tokens=32768, ls_hidden=1024, ls_layers=4, ls_heads=8,
                 ls_kv=8, ls_vocab=32000, ls_tiles=8, ls_repeats=3, hf_hidden=512, hf_heads=4,
                 hf_kv=2, hf_ffn=1024, hf_vocab=1024),
    "cpu": dict(lengths=(100, 7, 53, 200), heads=4, kv_heads=2, head_dims=(16, 8, 32), frame=8,
                ring_lengths=(90, 31, 200), ring_layouts=((1, 2), (1, 4), (1, 8), (2, 2)),
                long=1024, long_heads=4, long_kv=2, pack=(8, 128), model_hidden=32,
                model_layers=2, model_heads=4, model_kv=2, model_lengths=(40, 9, 64, 3),
                mem_hidden=32, mem_layers=2, mem_heads=4, mem_kv=2, mem_vocab=512, mem_tokens=256,
                ls_tokens=256, ls_hidden=32, ls_layers=2, ls_heads=4, ls_kv=2, ls_vocab=512,
                ls_tiles=4, ls_repeats=1, hf_hidden=64, hf_heads=4, hf_kv=2, hf_ffn=96,
                hf_vocab=64),
}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2,
             torch.float16: 1e-2}
MEMORY_TOLERANCE = 0.10
"""Measured / predicted activation memory of a planned step must lie within 1 +- this."""
SECTION_LIMIT_S = {"environment": 30, "exactness": 75, "ring": 30, "throughput": 45,
                   "run_plan": 30, "memory": 45, "long_sequences": 60, "megatron": 45, "hf": 45,
                   "deepspeed": 75, "calibration": 40, "profile": 150}
"""Seconds each section may run (an alarm ends it); the whole run is also held to ``--budget``."""
HANG_GRACE_S = 30.0
"""A section still running this long after its limit (stuck in C code the alarm cannot
interrupt, e.g. a collective) ends the script: the report so far is written first."""


class Skip(Exception):
    """A section that cannot run here (the reason is recorded)."""


class SectionTimeout(Exception):
    """A section ran past its time limit."""


class SectionFailure(AssertionError):
    """A section failed but has numbers to report (``result``)."""

    def __init__(self, message: str, result: dict) -> None:
        super().__init__(message)
        self.result = result


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (in float64, on the CPU)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def packed(lengths, heads, kv_heads, head_dim, device, dtype, seed=0):
    """Random packed q, k, v, dout of ``lengths`` on ``device`` in ``dtype``, with values exact in
    both bf16 and fp16 (bf16-rounded, tiny ones zeroed), so one float64 reference serves both."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    out = []
    for h in (heads, kv_heads, kv_heads, heads):
        x = torch.randn(n, h, head_dim, generator=gen).to(torch.bfloat16).float()
        x[x.abs() < 2.0 ** -14] = 0.0
        out.append(x.to(dtype).to(device))
    return out


def local_fwd_bwd(q, k, v, dout, meta, causal, scale, groups, backend):
    """``[out, dq, dk, dv]`` of `kernels.local_attention` through autograd with ``backend``."""
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with kernels.forced_backend(backend):
        out = kernels.local_attention(*ins, meta, causal=causal, softmax_scale=scale,
                                      groups=groups)
        return [out.detach(), *torch.autograd.grad(out, ins, dout)]


def timed(fn: Callable, device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up (CUDA events on CUDA)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def half_tolerance(dtype) -> float:
    """Relative tolerance of gradients computed twice in ``dtype`` (different kernels/order)."""
    return 3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5


# ---------------------------------------------------------------------------- sync check
_SYNC_WORDS = ("synchronizing", "host read of a device value")


class _HostReads(torch.overrides.TorchFunctionMode):
    """The CPU stand-in of CUDA's sync checker: while ``enabled``, reading a floating-point
    tensor on the host raises."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
             torch.Tensor.nonzero, torch.nonzero}

    def __init__(self) -> None:
        super().__init__()
        self.enabled = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.enabled and func in self.READS and args and isinstance(args[0], torch.Tensor) \
                and args[0].is_floating_point():
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(f"called a synchronizing operation (CPU stand-in: host read of a "
                               f"device value, Tensor.{name} of a {args[0].dtype} tensor "
                               f"{tuple(args[0].shape)})")
        return func(*args, **(kwargs or {}))


class _OffWhenBackwardEnds(torch.autograd.Function):
    """Identity on the loss whose backward queues ``check.off`` for the end of the backward."""

    @staticmethod
    def forward(ctx, loss, check):
        ctx.check = check
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.check.off)
        return grad, None


class SyncCheck:
    """The device's host-sync checker, turned on only inside tasks (module doc).

    ``active``: check at all (False: the unchecked rerun); ``inject``: `probe` reads a value on
    the host (the negative control). `on` at a task's start, `off` when its backward ended
    (directly, or `off_after_backward` on the task's loss), `close` when the step is over. On
    the CPU `on`/`off` only switch the stand-in, pushed once: ``off`` may run inside the mode's
    own handler (a backward called while it is on), where popping it would fail.
    """

    def __init__(self, device: torch.device, active: bool, inject: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.active = active
        self.inject = inject
        self._mode: Optional[_HostReads] = None

    def on(self) -> None:
        if not self.active:
            return
        if self.cuda:
            torch.cuda.set_sync_debug_mode("error")
            return
        if self._mode is None:
            self._mode = _HostReads()
            self._mode.__enter__()
        self._mode.enabled = True

    def off(self) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
        elif self._mode is not None:
            self._mode.enabled = False

    def close(self) -> None:
        """`off`, and the CPU stand-in popped (call where it was pushed: the step's thread)."""
        self.off()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def off_after_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` unchanged, with `off` called once the backward through it has ended."""
        return _OffWhenBackwardEnds.apply(loss, self) if self.active else loss

    def probe(self, x: torch.Tensor) -> None:
        """With ``inject``: a host read of a device value (a sync on CUDA)."""
        if self.inject:
            float(x.detach().reshape(-1)[:1].float().sum())

    @staticmethod
    def sync_in(exc: BaseException) -> Optional[str]:
        """The message of the sync error in ``exc``'s chain (``None``: not a sync)."""
        seen = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            text = str(exc)
            if any(w in text for w in _SYNC_WORDS):
                return f"{type(exc).__name__}: {text}"[-1500:]
            exc = exc.__cause__ or exc.__context__
        return None


def sync_checked(ctx, run: Callable[[SyncCheck], Any]) -> tuple[Any, Optional[str]]:
    """``run(check)`` under the sync checker; a sync inside a task is returned as the second
    value after ``run`` ran again unchecked (its numbers); any other error propagates."""
    dev, inject = ctx["device"], ctx["inject_sync"]
    check = SyncCheck(dev, active=True, inject=inject)
    try:
        return run(check), None
    except Exception as exc:  # noqa: BLE001 - only a sync is caught here
        found = SyncCheck.sync_in(exc)
        if found is None:
            raise
    finally:
        check.close()
    return run(SyncCheck(dev, active=False, inject=inject)), found


def fail_on_sync(result: dict, found: Optional[str]) -> dict:
    """``result`` with ``host_sync_in_task``; raises `SectionFailure` when a sync was found."""
    result["host_sync_in_task"] = found
    if found is not None:
        raise SectionFailure(f"host sync inside a task: {found}", result)
    return result


# ---------------------------------------------------------------------------- kernel sections
def _version(module: str) -> Optional[str]:
    """The version of an optional package, or why it does not import."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - optional
        return f"missing ({type(exc).__name__}: {exc})"[:300]
    return str(getattr(mod, "__version__", "?"))


def _backends_for(dev, dtype, head_dim) -> list[str]:
    probe = torch.zeros(1, 1, head_dim, dtype=dtype, device=dev)
    return [b for b in kernels.BACKENDS if backends.supports(b, probe)]


def section_environment(ctx) -> dict:
    """Versions, the optional packages and which backends exist per dtype and head dim."""
    dev = ctx["device"]
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": str(dev), "dtype": str(ctx["dtype"]),
            "kernel_dtypes": [str(d) for d in ctx["kernel_dtypes"]]}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info["name"] = torch.cuda.get_device_name(dev)
        info["capability"] = list(torch.cuda.get_device_capability(dev))
        info["total_memory_bytes"] = int(props.total_memory)
        nccl = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    info["packages"] = {name: _version(module) for name, module in (
        ("flash-attn", "flash_attn"), ("megatron-core", "megatron.core"),
        ("transformers", "transformers"), ("deepspeed", "deepspeed"), ("numpy", "numpy"))}
    info["backends"] = {f"{str(dt).split('.')[-1]}/d{d}": _backends_for(dev, dt, d)
                        for dt in ctx["kernel_dtypes"] for d in ctx["size"]["head_dims"]}
    probe = torch.zeros(1, 1, ctx["size"]["head_dims"][0], dtype=ctx["dtype"], device=dev)
    info["selected_backend"] = kernels.resolve_backend(probe)
    return info


_CASES = ("causal", "non-causal", "video-spatial", "video-temporal")


def section_exactness(ctx) -> dict:
    """Every backend vs the float64 CPU exact kernel: packed varlen GQA, per dtype and head dim."""
    sz, dev = ctx["size"], ctx["device"]
    lengths, frame = sz["lengths"], sz["frame"]
    cases = {"causal": (True, None), "non-causal": (False, None),
             "video-spatial": (False, lambda p: p // frame),
             "video-temporal": (True, lambda p: p % frame)}
    meta_host = ShardLayout.build(lengths, 1, 1, 0).meta()
    meta = meta_host.to(dev)
    results, failures, missing = {}, [], []
    if dev.type == "cuda" and "flash" not in _backends_for(dev, torch.bfloat16, 128):
        missing.append("flash (flash-attn not installed or unusable: its backend not checked)")
    for dim in sz["head_dims"]:
        refs: dict[str, list] = {}  # inputs are exact in bf16 and fp16: one reference per case
        scale = dim ** -0.5
        for dtype in ctx["kernel_dtypes"]:
            main = dim == sz["head_dims"][0] and dtype == ctx["dtype"]
            q, k, v, dout = packed(lengths, sz["heads"], sz["kv_heads"], dim, dev, dtype)
            for backend in _backends_for(dev, dtype, dim):
                for name in _CASES if main else _CASES[:2]:
                    causal, fn = cases[name]
                    if name not in refs:
                        refs[name] = local_fwd_bwd(*(t.cpu().double() for t in (q, k, v, dout)),
                                                   meta_host, causal, scale,
                                                   kernels.attention_groups(fn, meta_host),
                                                   "torch")
                    got = local_fwd_bwd(q, k, v, dout, meta, causal, scale,
                                        kernels.attention_groups(fn, meta), backend)
                    errs = {label: rel_err(g, r)
                            for label, g, r in zip(("out", "dq", "dk", "dv"), got, refs[name])}
                    key = f"{str(dtype).split('.')[-1]}/d{dim}/{backend}/{name}"
                    results[key] = errs
                    if max(errs.values()) > TOLERANCE[dtype]:
                        failures.append(f"{key}: {errs} > {TOLERANCE[dtype]}")
    result = {"tolerance": {str(d): TOLERANCE[d] for d in ctx["kernel_dtypes"]},
              "lengths": list(lengths), "head_dims": list(sz["head_dims"]),
              "not_checked": missing, "errors": results}
    if failures:
        raise SectionFailure("; ".join(failures), result)
    return result


def section_ring(ctx) -> dict:
    """Ring and hybrid layouts simulated in one process vs one full-sequence call, per dtype."""
    sz, dev = ctx["size"], ctx["device"]
    lengths, dim = sz["ring_lengths"], sz["head_dims"][0]
    scale = dim ** -0.5
    meta = ShardLayout.build(lengths, 1, 1, 0).meta().to(dev)
    results, failures, used = {}, [], {}
    for dtype in ctx["kernel_dtypes"]:
        q, k, v, dout = packed(lengths, sz["heads"], sz["kv_heads"], dim, dev, dtype, 1)
        backend = used[str(dtype)] = kernels.resolve_backend(q)
        for causal in (True, False):
            want = local_fwd_bwd(q, k, v, dout, meta, causal, scale, None, backend)
            for u, r in sz["ring_layouts"]:
                with kernels.forced_backend(backend):
                    got = ring_in_one_process(q, k, v, lengths, u, r, causal=causal, scale=scale,
                                              dout=dout)
                errs = {label: rel_err(g, w)
                        for label, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
                key = (f"{str(dtype).split('.')[-1]}/{'causal' if causal else 'non-causal'}/"
                       f"ulysses {u} x ring {r}")
                results[key] = errs
                if max(errs.values()) > TOLERANCE[dtype]:
                    failures.append(f"{key}: {errs}")
    result = {"backend": used, "lengths": list(lengths), "errors": results}
    if failures:
        raise SectionFailure("; ".join(failures), result)
    return result


def _single_call(q, k, v, dout, lengths, scale):
    """Forward + backward of one kernel call over all of ``lengths`` (the yardstick): torch's
    flash varlen ops on CUDA, torch's fused CPU op per sequence on the CPU."""
    if q.device.type == "cuda":
        cu = torch.tensor([0, *lengths], device=q.device).cumsum(0).to(torch.int32)
        m = max(lengths)
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)

        def run():
            o, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, True,
                                                             False, scale=scale)[:2]
            torch.ops.aten._flash_attention_backward(dout, q, k, v, o, lse, cu, cu, m, m, 0.0,
                                                     True, rng, unused, scale=scale)
        return run

    def run_cpu():
        start = 0
        for n in lengths:
            qs, ks, vs, ds = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v, dout))
            o, lse = backends._CPU_FWD(qs, ks, vs, 0.0, True, scale=scale)
            backends._CPU_BWD(ds, qs, ks, vs, o, lse, 0.0, True, scale=scale)
            start += n
    return run_cpu


def _causal_flops(lengths, heads, head_dim) -> float:
    """Forward + backward FLOPs of causal attention (2 + 5 matmuls over the visible pairs)."""
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    return 7 * 2 * pairs * heads * head_dim


def section_throughput(ctx) -> dict:
    """Ring-block path and local packed path vs one varlen call, same work (TFLOP/s)."""
    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    heads, kv, dim = sz["long_heads"], sz["long_kv"], sz["head_dims"][0]
    scale, reps = dim ** -0.5, 5 if dev.type == "cuda" else 2
    out = {}
    # ring: one long sequence; every rank's blocks of a degree-8 ring (the whole work, split)
    lengths = [sz["long"]]
    q, k, v, dout = packed(lengths, heads, kv, dim, dev, dtype, 2)
    flops = _causal_flops(lengths, heads, dim)
    t_ref = timed(_single_call(q, k, v, dout, lengths, scale), dev, reps)
    t_ring = timed(lambda: ring_in_one_process(q, k, v, lengths, 1, 8, causal=True, scale=scale,
                                               dout=dout), dev, reps)
    out["ring8"] = {"tokens": lengths[0], "single_call_tflops": flops / t_ref / 1e12,
                    "ring_blocks_tflops": flops / t_ring / 1e12, "ratio": t_ref / t_ring}
    # local: many packed sequences through local_attention (autograd) vs one call
    count, n = sz["pack"]
    lengths = [n] * count
    q, k, v, dout = packed(lengths, heads, kv, dim, dev, dtype, 3)
    meta = ShardLayout.build(lengths, 1, 1, 0).meta().to(dev)
    flops = _causal_flops(lengths, heads, dim)
    backend = kernels.resolve_backend(q)
    t_ref = timed(_single_call(q, k, v, dout, lengths, scale), dev, reps)
    t_local = timed(lambda: local_fwd_bwd(q, k, v, dout, meta, True, scale, None, backend), dev,
                    reps)
    out["local_packed"] = {"sequences": count, "tokens": n, "backend": backend,
                           "single_call_tflops": flops / t_ref / 1e12,
                           "local_tflops": flops / t_local / 1e12, "ratio": t_ref / t_local}
    if dev.type == "cuda":
        misses = [f"{name} {out[name]['ratio']:.2f} < {goal}"
                  for name, goal in (("ring8", 0.7), ("local_packed", 0.9))
                  if out[name]["ratio"] < goal]
        if misses:
            raise SectionFailure("below target: " + ", ".join(misses), out)
    else:
        out["note"] = "CPU: ratios reported, targets apply to CUDA only"
    return out


# ---------------------------------------------------------------------------- model sections
class _Engine(StepEngine):
    """The step driver's engine (`megatron_dcp.runtime.step.StepEngine`) for a plain module:
    ``loss(model, shard, per_token)``, gradients zeroed in place at the start of a step and
    SUM-reduced at its end, no optimizer step. The sync check is on from each task's forward
    until its backward has ended; ``on_finish`` runs after the last task, before the reduction."""

    def __init__(self, model, loss: Callable, check: SyncCheck, group=None,
                 on_finish: Optional[Callable[[], Any]] = None) -> None:
        self.model, self.loss, self.check, self.group = model, loss, check, group
        self.on_finish = on_finish

    def forward_loss(self, shard, per_token: bool) -> torch.Tensor:
        self.check.on()
        out = self.loss(self.model, shard, per_token)
        self.check.probe(out)
        return out

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        try:
            loss.backward()
        finally:
            self.check.off()

    def reduction_scope(self):
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        return contextlib.nullcontext()

    def finish(self) -> None:
        from megatron_dcp.runtime.executor import reduce_gradients

        if self.on_finish is not None:
            self.on_finish()
        reduce_gradients(list(self.model.parameters()), self.group)


def _decoder_loss(model, shard, per_token: bool) -> torch.Tensor:
    """The reference decoder's own loss path (`Decoder.loss`)."""
    return model.loss(shard.input_ids, shard.position_ids, shard.labels,
                      reduction="none" if per_token else "sum", task=shard.task)


def _logits_loss(model, shard, per_token: bool) -> torch.Tensor:
    """Cross-entropy of a model that returns logits ``[T, V]`` for ``(ids, positions, task)``."""
    from megatron_dcp.models.common import token_losses

    losses = token_losses(model(shard.input_ids, shard.position_ids, task=shard.task),
                          shard.labels)  # chunked: what the engines run
    return losses if per_token else losses.sum()


def _decoder_config(sz, **changes):
    from megatron_dcp.models import DecoderConfig

    values = dict(vocab_size=512, hidden_size=sz["model_hidden"], num_layers=sz["model_layers"],
                  num_heads=sz["model_heads"], num_kv_heads=sz["model_kv"],
                  max_position=max(sz["model_lengths"]))
    return DecoderConfig(**{**values, **changes})


def _two_tasks(lengths, recompute_layers: int):
    """Four sequences as two packed degree-1 tasks with ``recompute_layers`` (world 1)."""
    from megatron_dcp.plan.plan import Plan, Task

    return Plan(tasks=(Task(id=0, ranks=(0,), seqs=(0, 1), recompute_layers=recompute_layers),
                       Task(id=1, ranks=(0,), seqs=(2, 3), recompute_layers=recompute_layers,
                            start=1.0)),
                lengths=lengths, world_size=1)


def _grads_equal(a: dict, b: dict, tol: float) -> dict:
    zero = [n for n, g in a.items() if not bool(g.abs().sum() > 0)]
    if len(zero) == len(a):
        raise AssertionError("all gradients are zero: the step did not run")
    worst = max(rel_err(a[n], b[n]) for n in a)
    if not worst <= tol:
        raise AssertionError(f"gradients differ: {worst:.2e} > {tol}")
    return {"max_rel_diff": worst}


def _dtype_name(dtype) -> str:
    return str(dtype).split(".")[-1]


def section_run_plan(ctx) -> dict:
    """The reference decoder through run_plan, recompute 0 vs all layers, per kernel dtype."""
    from megatron_dcp.models import Decoder
    from megatron_dcp.runtime.executor import run_plan
    from megatron_dcp.runtime.groups import GroupPool

    sz, dev = ctx["size"], ctx["device"]
    lengths = sz["model_lengths"]
    cfg = _decoder_config(sz)
    gen = torch.Generator().manual_seed(4)
    batch = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    pool = GroupPool()

    def step(dtype, recompute_layers: int, check: SyncCheck):
        model = Decoder(cfg, seed=5).to(device=dev, dtype=dtype)

        def forward_step(shard):
            check.on()
            loss = model.loss(shard.input_ids, shard.position_ids, shard.labels,
                              task=shard.task)
            check.probe(loss)
            return loss

        def backward(loss):
            try:
                loss.backward()
            finally:
                check.off()
        stats = run_plan(_two_tasks(lengths, recompute_layers), batch, 0, forward_step, pool=pool,
                         backward=backward, device=dev, max_position=cfg.max_position)
        return stats.loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    result, found = {}, []
    for dtype in ctx["kernel_dtypes"]:
        (loss0, g0), f0 = sync_checked(ctx, lambda c: step(dtype, 0, c))
        (loss_all, g_all), f1 = sync_checked(ctx, lambda c: step(dtype, cfg.num_layers, c))
        found += [f for f in (f0, f1) if f]
        result[_dtype_name(dtype)] = {"loss": loss0, "loss_recompute_all": loss_all,
                                      **_grads_equal(g0, g_all, half_tolerance(dtype))}
    return fail_on_sync(result, found[0] if found else None)


def section_memory(ctx) -> dict:
    """Peak memory of a planned one-sequence step vs the planner's prediction for its task."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models import Decoder
    from megatron_dcp.plan import build_cost_model
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    cuda = dev.type == "cuda"
    n = sz["mem_tokens"]
    cfg = _decoder_config(sz, vocab_size=sz["mem_vocab"], hidden_size=sz["mem_hidden"],
                          num_layers=sz["mem_layers"], num_heads=sz["mem_heads"],
                          num_kv_heads=sz["mem_kv"], max_position=n)
    model = Decoder(cfg, seed=3).to(device=dev, dtype=dtype)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients are static memory: in the baseline
    config = DCPConfig(enabled=True)
    pool = GroupPool()
    driver = StepDriver(config, pool=pool, model_shape=model.shape(), device=dev, zero_stage=0)
    cost = build_cost_model(model.shape(), config, 1, driver.hardware, zero_stage=0)
    batch = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(8))]
    planned = driver.plan([n])
    if len(planned.tasks) != 1:
        raise AssertionError(f"one sequence, one rank: expected one task, got {planned.tasks}")
    task = planned.tasks[0]
    cases = {"planned": planned,
             "recompute_all": dataclasses.replace(planned, tasks=(dataclasses.replace(
                 task, recompute_layers=cfg.num_layers),))}
    result: dict = {"tokens": n, "vocab": cfg.vocab_size, "hardware": driver.hardware.name,
                    "static_memory_bytes": cost.memory_model.static_memory,
                    "reserve_bytes": cost.memory_model.reserve,
                    "cases": {}}
    misses = []
    for name, plan in cases.items():
        t = plan.tasks[0]
        predicted = cost.memory_model.task_memory(t, plan.lengths)
        row = {"recompute_layers": t.recompute_layers, "planner_task_memory_bytes": t.memory,
               "predicted_bytes": predicted,
               "predicted_activation_bytes": predicted - cost.memory_model.static_memory
               - cost.memory_model.reserve}
        peak: dict = {}

        def read_peak():
            if cuda:
                peak["allocated"] = torch.cuda.max_memory_allocated(dev)
                peak["reserved"] = torch.cuda.max_memory_reserved(dev)
        engine = _Engine(model, _decoder_loss, SyncCheck(dev, active=False), pool.world_group,
                         on_finish=read_peak)
        driver.step(engine, batch, plan)  # warm-up: kernels' workspaces, first-use buffers
        gc.collect()
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            row["baseline_bytes"] = base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        driver.step(engine, batch, plan)
        if cuda:
            row["peak_allocated_bytes"] = peak["allocated"]
            row["peak_reserved_bytes"] = peak["reserved"]
            row["measured_activation_bytes"] = measured = peak["allocated"] - base
            row["ratio"] = ratio = measured / row["predicted_activation_bytes"]
            if abs(ratio - 1) > MEMORY_TOLERANCE:
                misses.append(f"{name}: measured / predicted {ratio:.3f}")
        else:
            row["measured_activation_bytes"] = row["ratio"] = None
        result["cases"][name] = row
    del model, engine
    if not cuda:
        result["note"] = "CPU: predictions only, no allocator peak; the 10 % target is CUDA's"
    if misses:
        raise SectionFailure(f"memory outside 1 +- {MEMORY_TOLERANCE}: " + ", ".join(misses),
                             result)
    return result


def section_long_sequences(ctx) -> dict:
    """One long sequence as a one-rank task with every layer recomputed: recompute only, MLP
    tiles, loss tiles, every layer offloaded, all three. Loss and gradients equal recompute
    only's; step time against it (offload: the exposed seconds and the share of its copy time
    that compute hides, copies timed at the measured pinned-host bandwidth); peak memory against
    the planner's `MemoryModel.task_memory` (`long_memory_of` for the tiled and offloaded cases;
    CUDA, the 10 % target theirs; on the CPU the prediction is reported)."""
    import megatron_dcp.models.decoder as decoder_module
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models import Decoder
    from megatron_dcp.plan import build_cost_model
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime import offload
    from megatron_dcp.runtime.context import TaskContext

    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    cuda = dev.type == "cuda"
    n, layers, tiles = sz["ls_tokens"], sz["ls_layers"], sz["ls_tiles"]
    cfg = _decoder_config(sz, vocab_size=sz["ls_vocab"], hidden_size=sz["ls_hidden"],
                          num_layers=layers, num_heads=sz["ls_heads"], num_kv_heads=sz["ls_kv"],
                          max_position=n)
    model = Decoder(cfg, seed=6).to(device=dev, dtype=dtype)
    memory = build_cost_model(model.shape(), DCPConfig(enabled=True), 1, zero_stage=0,
                              long_sequences=True).memory_model
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(dev)
    labels = torch.cat([ids[1:], torch.tensor([-100], device=dev)])
    layout = ShardLayout.build([n], 1, 1, 0)
    pos = layout.position_ids.to(dev)
    cases = {"recompute": {}, "mlp_tiles": dict(mlp_tiles=tiles), "loss_tiles": dict(
        loss_tiles=tiles), "offload": dict(offload_layers=layers),
        "all": dict(mlp_tiles=tiles, loss_tiles=tiles, offload_layers=layers)}
    stashes: list = []

    def counting_stash(task, store="memory"):
        stash = offload.stash_for(task, store)
        if stash is not None:
            stashes.append(stash)
        return stash

    def step(task_ctx):
        for p in model.parameters():
            p.grad = None if p.grad is None else p.grad.zero_()
        loss = model.loss(ids, pos, labels, task=task_ctx)
        loss.backward()
        return loss.detach()

    result: dict = {"tokens": n, "layers": layers, "tiles": tiles, "dtype": _dtype_name(dtype),
                    "cases": {}}
    misses, reference = [], None
    decoder_module.stash_for, real_stash = counting_stash, decoder_module.stash_for
    try:
        for name, choices in cases.items():
            task = Task(id=0, ranks=(0,), seqs=(0,), recompute_layers=layers, **choices)
            task_ctx = TaskContext(task=task, group_rank=0, layout=layout, recompute_layers=layers)
            predicted = memory.task_memory(task, [n]) - memory.static_memory - memory.reserve
            loss = step(task_ctx)  # also the warm-up; the gradients stay (static memory)
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
            row: dict = {**choices, "loss": float(loss), "predicted_activation_bytes": predicted}
            if reference is None:
                reference = (loss, grads)
            else:
                row["loss_rel_diff"] = rel_err(loss, reference[0])
                row.update(_grads_equal(grads, reference[1], half_tolerance(dtype)))
            del grads
            if cuda:
                gc.collect()
                torch.cuda.synchronize(dev)
                base = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                step(task_ctx)
                torch.cuda.synchronize(dev)
                row["measured_activation_bytes"] = measured = \
                    torch.cuda.max_memory_allocated(dev) - base
                row["ratio"] = ratio = measured / predicted
                if name != "recompute" and abs(ratio - 1) > MEMORY_TOLERANCE:
                    misses.append(f"{name}: measured / predicted {ratio:.3f}")
            stashes.clear()
            row["step_s"] = timed(lambda: step(task_ctx), dev, sz["ls_repeats"])
            row["offload_copied_bytes"] = stashes[-1].copied_bytes if stashes else 0
            result["cases"][name] = row
    finally:
        decoder_module.stash_for = real_stash
    base_s = result["cases"]["recompute"]["step_s"]
    for row in result["cases"].values():
        row["vs_recompute"] = row["step_s"] / base_s
    bandwidth = _host_link_bandwidth(dev, result["cases"]["offload"]["offload_copied_bytes"])
    copy_s = result["cases"]["offload"]["offload_copied_bytes"] / bandwidth
    exposed = max(0.0, result["cases"]["offload"]["step_s"] - base_s)
    result["offload"] = {"host_link_bytes_per_s": bandwidth, "copy_s": copy_s,
                         "exposed_s": exposed,
                         "hidden_share": max(0.0, 1 - exposed / copy_s) if copy_s else None}
    if not cuda:
        result["note"] = "CPU: predictions only, no allocator peak; the 10 % target is CUDA's"
    if misses:
        raise SectionFailure(f"memory outside 1 +- {MEMORY_TOLERANCE}: " + ", ".join(misses),
                             result)
    return result


def _host_link_bandwidth(dev, nbytes: int) -> float:
    """Bytes/s of one device -> pinned host copy and back (half the round trip's bytes per
    second each way), over ``nbytes`` split in two (at least 1 MiB)."""
    half = max(2**20, nbytes // 2)
    x = torch.empty(half, dtype=torch.uint8, device=dev)
    host = torch.empty(half, dtype=torch.uint8, pin_memory=dev.type == "cuda")

    def round_trip():
        host.copy_(x, non_blocking=True)
        x.copy_(host, non_blocking=True)
    seconds = timed(round_trip, dev, 3)
    return 2 * half / max(seconds, 1e-9)


def off_device(model: torch.nn.Module, dev: torch.device) -> list[str]:
    """Names of ``model``'s tensors not on ``dev``: parameters, buffers and plain tensor
    attributes (megatron-core's RoPE keeps ``inv_freq`` as an attribute, which ``.to`` leaves on
    the host under ``use_cpu_initialization``: the first forward copies it from pageable memory,
    a host sync inside the checked window)."""
    names = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
             if t.device != dev]
    for prefix, module in model.named_modules():
        names += [f"{prefix}.{k}".lstrip(".") for k, v in vars(module).items()
                  if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)
                  and v.device != dev]
    return names


def model_to(model: torch.nn.Module, dev: torch.device) -> torch.nn.Module:
    """``model.to(dev)`` with its plain tensor attributes too (`off_device`)."""
    model = model.to(dev)
    for module in model.modules():
        for k, v in list(vars(module).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) \
                    and v.device != dev:
                setattr(module, k, v.to(dev))
    return model


def section_megatron(ctx) -> dict:
    """A megatron-core GPTModel (DCP spec) through DCPForwardBackward, recompute 0 vs all."""
    try:
        from megatron.core import parallel_state
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as exc:  # noqa: BLE001 - optional dependency
        raise Skip(f"megatron-core does not import: {exc}")
    from functools import partial

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.cpu.core import enable_cpu, seed_rng
    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.megatron.spec import get_gpt_layer_dcp_spec
    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch

    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    if dev.type == "cpu":
        enable_cpu()
    parallel_state.initialize_model_parallel()
    lengths, vocab = sz["model_lengths"], 512
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]

    def step(recompute_layers: int, check: SyncCheck):
        seed_rng(7)
        cfg = TransformerConfig(
            num_layers=sz["model_layers"], hidden_size=sz["model_hidden"],
            num_attention_heads=sz["model_heads"], num_query_groups=sz["model_kv"],
            use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16, normalization="RMSNorm", gated_linear_unit=True,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            masked_softmax_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False,
            bias_dropout_fusion=False, calculate_per_token_loss=True)
        model = GPTModel(cfg, get_gpt_layer_dcp_spec(), vocab_size=vocab,
                         max_sequence_length=max(lengths), position_embedding_type="rope")
        model = model_to(model, dev)
        stray = off_device(model, dev)
        if stray:  # read inside the checked window, they would be host syncs
            raise SectionFailure(f"model tensors not on {dev}: {', '.join(stray[:5])}", {})
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), module=model)

        def loss_func(loss_mask, output):
            losses = output.view(-1).float()
            loss = (losses * loss_mask.view(-1)).sum()
            check.probe(loss)
            # the checker goes off when this task's backward has ended (Megatron runs it)
            return (check.off_after_backward(loss), loss_mask.sum().to(torch.int),
                    {"lm loss": loss.detach()})

        def forward_step(data_iterator, model):
            check.on()  # a task's forward starts here; the plan check ran before
            b = next(data_iterator)
            out = model(b["tokens"], b["position_ids"], b["attention_mask"],
                        labels=b["labels"], packed_seq_params=b["packed_seq_params"])
            return out, partial(loss_func, b["loss_mask"])
        ddp.zero_grad_buffer()
        driver = DCPForwardBackward(DCPConfig(enabled=True))
        plan = _two_tasks(lengths, recompute_layers)
        driver(forward_step_func=forward_step, data_iterator=iter([GlobalBatch(seqs, plan)]),
               model=[ddp], num_microbatches=1, seq_length=0, micro_batch_size=1)
        return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}

    try:
        g0, f0 = sync_checked(ctx, lambda c: step(0, c))
        g_all, f1 = sync_checked(ctx, lambda c: step(sz["model_layers"], c))
        result = _grads_equal(g0, g_all, half_tolerance(dtype))
    finally:
        destroy_model_parallel()  # Megatron's, and the group globals it leaves set
    return fail_on_sync(result, f0 or f1)


def section_hf(ctx) -> dict:
    """Tiny HF Llama and Qwen2 under DCP vs the same model with its own attention."""
    try:
        import transformers
    except Exception as exc:  # noqa: BLE001 - optional dependency
        raise Skip(f"transformers does not import: {exc}")
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.integrations.hf import DCPCausalLM
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    lengths = sz["model_lengths"]
    common = dict(vocab_size=sz["hf_vocab"], hidden_size=sz["hf_hidden"],
                  intermediate_size=sz["hf_ffn"], num_hidden_layers=2,
                  num_attention_heads=sz["hf_heads"], num_key_value_heads=sz["hf_kv"],
                  max_position_embeddings=max(lengths), attention_dropout=0.0)
    kinds = {"llama": ("LlamaConfig", dict(common, tie_word_embeddings=True)),
             "qwen2": ("Qwen2Config", dict(common))}  # q/k/v biases
    gen = torch.Generator().manual_seed(9)
    batch = [torch.randint(0, common["vocab_size"], (n,), generator=gen) for n in lengths]
    total = sum(n - 1 for n in lengths)
    pool = GroupPool()
    # bf16/fp16: packed flash varlen vs HF's SDPA one sequence at a time, rounded differently
    tol = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    result, found = {}, []
    for kind, (name, values) in kinds.items():
        config = getattr(transformers, name)(**values)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).to(device=dev, dtype=dtype)
        model.train()
        reference = copy.deepcopy(model)  # keeps HF's own attention
        loss = torch.zeros((), device=dev)
        for ids in batch:
            ids = ids.to(dev)
            logits = reference(input_ids=ids[None], use_cache=False).logits[0]
            loss = loss + F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")
        (loss / total).backward()
        want = {n: p.grad for n, p in reference.named_parameters()}
        want_loss = float(loss) / total
        del reference

        wrapped = DCPCausalLM(model)
        driver = StepDriver(DCPConfig(enabled=True), pool=pool, model_shape=wrapped.shape(),
                            device=dev)
        plan = _two_tasks(lengths, 0)
        plan = dataclasses.replace(plan, tasks=(plan.tasks[0], dataclasses.replace(
            plan.tasks[1], recompute_layers=common["num_hidden_layers"])))

        def run(check: SyncCheck):
            engine = _Engine(wrapped, _logits_loss, check, pool.world_group)
            return driver.step(engine, batch, plan).loss
        got_loss, sync = sync_checked(ctx, run)
        found += [sync] if sync else []
        got = {n: p.grad for n, p in wrapped.named_parameters()}
        result[kind] = {"loss": got_loss, "reference_loss": want_loss,
                        "loss_rel_diff": abs(got_loss - want_loss) / abs(want_loss),
                        **_grads_equal(got, want, tol)}
        if result[kind]["loss_rel_diff"] > tol:
            raise SectionFailure(f"{kind}: loss differs from HF's own attention", result)
    return fail_on_sync(result, found[0] if found else None)


def section_deepspeed(ctx) -> dict:
    """deepspeed_plugin.initialize at world size 1, ZeRO-1 and ZeRO-3: two DCP steps against two
    plain DeepSpeed steps (AdamW), equal losses."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - optional dependency
        raise Skip(f"deepspeed does not import: {exc}")
    import deepspeed_plugin
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models import Decoder

    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    if dtype == torch.float64:
        raise Skip("DeepSpeed trains in fp32, bf16 or fp16, not float64")
    for key, value in (("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)  # what a launcher sets; the world group exists
    cfg = _decoder_config(sz)
    gen = torch.Generator().manual_seed(10)
    batches = [[torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
               for lengths in (sz["model_lengths"], sz["model_lengths"][::-1])]
    precision = {"bf16": {"enabled": dtype == torch.bfloat16},
                 "fp16": {"enabled": dtype == torch.float16, "initial_scale_power": 8}}
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    result, failures = {}, []
    for stage in (1, 3):
        losses = {}
        for mode in ("dcp", "plain"):
            model = Decoder(cfg, seed=5)
            config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                      "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
                      "zero_optimization": {"stage": stage, "overlap_comm": False},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0,
                                                                "torch_adam": True}},
                      **precision}
            engine, *_ = deepspeed_plugin.initialize(
                model=model, model_parameters=model.parameters(), config=config,
                dcp_config=DCPConfig(enabled=mode == "dcp"), model_shape=model.shape())
            try:
                losses[mode] = [engine.train_step(b).loss for b in batches]
            finally:
                engine.deepspeed.destroy()
                del engine
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses["dcp"], losses["plain"]))
        result[f"zero{stage}"] = {"dcp_losses": losses["dcp"], "plain_losses": losses["plain"],
                                  "max_rel_diff": diff}
        if not diff <= tol:
            failures.append(f"ZeRO-{stage}: DCP losses {losses['dcp']} vs plain "
                            f"{losses['plain']} (rel {diff:.2e} > {tol})")
    result["tolerance"] = tol
    if failures:
        raise SectionFailure("; ".join(failures), result)
    return result


def section_calibration(ctx) -> dict:
    """``--dcp_hardware auto`` on this device, then the online calibration over a few planned
    steps of the reference decoder (world 1, a pack budget of half the longest sequence so each
    step has several tasks): predicted vs measured step time per step, and the fitted factors
    (how far the starting numbers are from this device)."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models import Decoder
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    longest = max(sz["model_lengths"])
    cfg = _decoder_config(sz)
    model = Decoder(cfg, seed=5).to(device=dev, dtype=dtype)
    pool = GroupPool()
    engine = _Engine(model, _decoder_loss, SyncCheck(dev, active=False), pool.world_group)
    driver = StepDriver(DCPConfig(enabled=True, pack_tokens=max(longest // 2, 8)), pool=pool,
                        model_shape=model.shape(), device=dev)
    start = driver.hardware.name
    gen = torch.Generator().manual_seed(6)
    rows = []
    for _ in range(8):
        count = int(torch.randint(6, 16, (1,), generator=gen))
        lengths = [max(2, int(longest * float(torch.rand(1, generator=gen)) ** 3))
                   for _ in range(count)]
        batch = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
        result = driver.step(engine, batch)
        rows.append({"tasks": len(result.plan.tasks), "step_s": round(result.wall_s, 5),
                     "predicted_s": round(result.predicted_s, 5),
                     "calibration_error": result.calibration_error})
    hw = driver.hardware
    return {"auto": start, "steps": rows, "factors": dict(hw.calibration or ()),
            "step_overhead_s": hw.step_overhead_s}


def section_profile(ctx) -> dict:
    """The hardware profiler CLI (tools/profile_hardware.py) by subprocess, within the time the
    section has."""
    dev = ctx["device"]
    script = os.path.join(ROOT, "tools", "profile_hardware.py")
    if not os.path.exists(script):
        raise Skip("no hardware profiler in tools/")
    try:
        import numpy  # noqa: F401 - the profiler's fits
    except Exception as exc:  # noqa: BLE001 - optional dependency
        raise Skip(f"the hardware profiler needs numpy, which does not import: {exc}")
    out = os.path.join(ROOT, "runs", f"hardware_{ctx['hardware_name']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cmd = [sys.executable, script, "--device", dev.type, "--out", out,
           "--name", ctx["hardware_name"]]
    cmd += ["--dtype", "bfloat16"] if dev.type == "cuda" else ["--quick", "--ranks", "0"]
    limit = max(5.0, ctx["section_deadline"] - time.monotonic() - 5.0)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"profiler ran past {limit:.0f} s: {' '.join(cmd)}")
    if res.returncode != 0:
        raise AssertionError(f"profiler exit {res.returncode}: {res.stderr[-2000:]}")
    return {"command": " ".join(cmd), "out": out, "tail": res.stdout[-1500:]}


# ---------------------------------------------------------------------------- runner
def _init_world(dev) -> str:
    """A one-rank process group (NCCL on CUDA, gloo on the CPU)."""
    import torch.distributed as dist

    from megatron_dcp.runtime.groups import before_init_process_group

    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dist.is_initialized():
        return backend
    store = tempfile.NamedTemporaryFile(prefix="dcp_gpu_check_", delete=False).name
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    before_init_process_group()
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120), **kwargs)
    return backend


def _with_world(fn: Callable, ctx: dict) -> Any:
    """``fn(ctx)`` once the one-rank world group exists (made on first use)."""
    if ctx.get("world") is None:
        ctx["world"] = _init_world(ctx["device"])
    return fn(ctx)


def install_wheels(folder: str) -> dict:
    """Make the wheels in ``folder`` importable without network: ``pip install --no-deps
    --no-index --target`` into a fresh folder put first on ``sys.path`` (unpacked there when pip
    is missing). Returns what was done."""
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    target = tempfile.mkdtemp(prefix="dcp_gpu_check_wheels_")
    info: dict = {"folder": folder, "wheels": [os.path.basename(w) for w in wheels],
                  "target": target}
    if not wheels:
        info["error"] = "no .whl files"
        return info
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
           "--disable-pip-version-check", "--target", target, *wheels]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        info["pip_exit"] = res.returncode
        if res.returncode != 0:
            info["pip_error"] = res.stderr[-1500:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["pip_exit"], info["pip_error"] = None, str(exc)
    if info["pip_exit"] != 0:  # pure-Python wheels are zip files laid out for site-packages
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(target)
        info["unpacked"] = True
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (target, os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()
    return info


SECTIONS = {"environment": section_environment, "exactness": section_exactness,
            "ring": section_ring, "throughput": section_throughput,
            "run_plan": section_run_plan, "memory": section_memory,
            "long_sequences": section_long_sequences, "megatron": section_megatron,
            "hf": section_hf, "deepspeed": section_deepspeed,
            "calibration": section_calibration, "profile": section_profile}
NEEDS_WORLD = ("run_plan", "memory", "megatron", "hf", "deepspeed", "calibration")


class _Report:
    """The JSON report, rewritten after every section (and by the watchdog before it ends a
    hung run)."""

    def __init__(self, path: str, data: dict) -> None:
        self.path, self.data, self.lock = path, data, threading.Lock()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self) -> str:
        with self.lock:
            self.data["summary"] = {n: e["status"] for n, e in self.data["sections"].items()}
            text = json.dumps(self.data, indent=1, default=str)
            with open(self.path + ".tmp", "w") as f:
                f.write(text)
            os.replace(self.path + ".tmp", self.path)
        return text


def _watchdog(report: _Report, state: dict) -> None:
    """Ends the process when a section overruns its limit by `HANG_GRACE_S` (a hang the alarm
    cannot interrupt): the section is recorded as FAIL and the report written first."""
    while True:
        time.sleep(1.0)
        name, deadline = state.get("section"), state.get("deadline")
        if name is None or time.monotonic() < deadline + HANG_GRACE_S:
            continue
        report.data["sections"][name] = {
            "status": "FAIL", "seconds": round(time.monotonic() - state["started"], 2),
            "limit_s": state["limit"],
            "error": f"hung: still running {HANG_GRACE_S:.0f} s after its limit; the run was "
                     "ended here (later sections did not run)"}
        report.write()
        print(f"[gpu_check] {name}: hung, report written to {report.path}; exiting", flush=True)
        os._exit(3)


def _alarm(signum, frame):
    raise SectionTimeout("the section ran past its time limit")


def run_section(name: str, fn: Callable, ctx: dict, limit: float, state: dict) -> dict:
    """One section under its time limit: its entry for the report."""
    start = time.monotonic()
    ctx["section_deadline"] = start + limit
    state.update(section=name, started=start, deadline=start + limit, limit=limit)
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        entry = {"status": "PASS", "result": fn(ctx)}
    except Skip as exc:
        entry = {"status": "SKIP", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - every section reports, the next one runs
        entry = {"status": "FAIL", "error": "".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]}
        if isinstance(exc, SectionFailure):
            entry["result"] = exc.result
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        state.update(section=None)
        if ctx["device"].type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    entry["seconds"] = round(time.monotonic() - start, 2)
    entry["limit_s"] = limit
    gc.collect()
    if ctx["device"].type == "cuda":
        torch.cuda.empty_cache()
    return entry


NEEDS_MORE_GPUS = (
    "NCCL between ranks: Ulysses all-to-all, ring P2P and the gradient reduction over GPUs "
    "(one GPU runs world size 1 only)",
    "communicator memory per process group of the vocabulary, at 8+ ranks",
    "offload copies under concurrent NCCL traffic on other streams",
    "the Megatron-LM launcher's data path and MoE all-to-alls across GPUs",
)
"""What this one-GPU check cannot run: listed in every report (``not_run_needs_more_gpus``)."""

NO_GPU_STATUS = 3
"""Exit status when no GPU is there and ``--device cpu`` was not asked for."""


def run_sections(args: argparse.Namespace, ctx: dict, report: _Report, state: dict,
                 t_start: float) -> None:
    """Every section not skipped, within what is left of ``--budget``, its entry written to
    the report and a line printed as it ends; on a terminal a progress bar on stderr counts
    the sections and names the running one."""
    deadline = t_start + args.budget
    with Progress("gpu check", total=len(SECTIONS)) as bar:
        for name, fn in SECTIONS.items():
            bar.update(0, label=name)
            left = deadline - time.monotonic()
            if name in args.skip:
                entry = {"status": "SKIP", "reason": "--skip", "seconds": 0.0}
            elif left < 5:
                entry = {"status": "SKIP", "reason": f"time budget ({args.budget:.0f} s) spent",
                         "seconds": 0.0}
            else:
                if name in NEEDS_WORLD:  # the one-rank world, made inside the first's limit
                    fn = functools.partial(_with_world, fn)
                entry = run_section(name, fn, ctx, min(SECTION_LIMIT_S[name], left), state)
            report.data["sections"][name] = entry
            report.data["seconds_total"] = round(time.monotonic() - t_start, 2)
            report.write()
            bar.note(f"[gpu_check] {name}: {entry['status']} ({entry['seconds']} s)")
            if entry["status"] == "FAIL":
                bar.note(entry["error"])
            bar.update(label=name)


def main(argv=None) -> int:
    """Run the sections, print the summary, write the JSON report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None,
                   help="cuda (default where a GPU is); cpu: the CPU mode, a self-test of the "
                        "checks that checks no GPU path (asked for by name: without a GPU and "
                        "without it, the check stops, status 3)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32", "float64"], default=None,
                   help="of the model sections; default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--kernel-dtypes", default=None,
                   help="comma-separated dtypes of exactness, ring and run_plan; default: "
                        "bfloat16,float16 on CUDA, --dtype on the CPU")
    p.add_argument("--out", default=os.path.join("runs", "gpu_check.json"))
    p.add_argument("--skip", nargs="*", default=[], choices=list(SECTIONS),
                   help="sections to leave out")
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds for all sections; a section gets at most what is left")
    p.add_argument("--wheels", default=None,
                   help="folder of wheels (deepspeed, megatron-core, transformers and their "
                        "dependencies) to install first, without network")
    p.add_argument("--inject-sync", action="store_true",
                   help="negative control: read a value on the host inside every task (the "
                        "sync-checked sections must fail)")
    p.add_argument("--hardware-name", default=None, help="default: h200 on CUDA, cpu otherwise")
    args = p.parse_args(argv)
    if args.device is None and not torch.cuda.is_available():
        print("[gpu_check] no GPU here (torch.cuda.is_available() is False): nothing was "
              "checked. Run it on a GPU machine, or give --device cpu for the CPU mode (a "
              "self-test of the checks, not a check of any GPU path)", flush=True)
        return NO_GPU_STATUS
    if args.device is not None and torch.device(args.device).type == "cpu":
        print("[gpu_check] CPU mode: a self-test of the checks; no GPU path (CUDA kernels, "
              "NCCL, pinned copies) is checked", flush=True)
    t_start = time.monotonic()
    wheels = install_wheels(args.wheels) if args.wheels else None
    dev = torch.device(args.device or "cuda")
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    kernel_dtypes = [getattr(torch, d) for d in (args.kernel_dtypes or (
        "bfloat16,float16" if dev.type == "cuda" and not args.dtype else str(dtype)[6:]))
        .split(",")]
    if dtype not in kernel_dtypes:
        kernel_dtypes.insert(0, dtype)
    ctx = {"device": dev, "dtype": dtype, "kernel_dtypes": kernel_dtypes,
           "size": SIZES[dev.type], "inject_sync": args.inject_sync,
           "hardware_name": args.hardware_name or ("h200" if dev.type == "cuda" else "cpu")}
    report = _Report(args.out, {
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
        "budget_s": args.budget, "wheels": wheels, "gpu_checked": dev.type == "cuda",
        "not_run_needs_more_gpus": list(NEEDS_MORE_GPUS), "sections": {}})
    state: dict = {}
    threading.Thread(target=_watchdog, args=(report, state), daemon=True).start()
    run_sections(args, ctx, report, state, t_start)
    if ctx.get("world") is not None:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()  # freed now: no NCCL thread outlives the interpreter
    report.data["seconds_total"] = round(time.monotonic() - t_start, 2)
    print(report.write())
    summary = report.data["summary"]
    print("[gpu_check] summary: " + ", ".join(f"{n} {s}" for n, s in summary.items()))
    print("[gpu_check] not run (they need more than one GPU): "
          + "; ".join(NEEDS_MORE_GPUS), flush=True)
    if dev.type != "cuda":
        print("[gpu_check] CPU mode: no GPU path was checked", flush=True)
    return 1 if "FAIL" in summary.values() else 0


if __name__ == "__main__":
    sys.exit(main())
