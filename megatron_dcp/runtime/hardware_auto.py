"""``--dcp_hardware auto``: the cost model's starting hardware for the device the run is on.

* CUDA: the preset whose name is in the device name (H200, H100, A100); any other GPU: the H100
  preset with its compute rates scaled by a quick measured bf16 GEMM rate (a fraction of a
  second; the smallest over the ranks, so that every rank plans with the same numbers).
* CPU: `cpu_start`, an uncalibrated start (rates typical of one core of a server CPU, gloo's
  effective bandwidth, the pack curve CPUs show) that the online calibration corrects within a
  few steps (`megatron_dcp.plan.calibration`).

Every rank must resolve the same hardware: presets and the CPU start depend only on the device
kind and on the host's memory and local rank count; a measured GPU rate is reduced over ranks.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dcp.plan.hardware import PRESETS, Hardware

CPU_PACK_CURVE = ((256.0, 0.8), (2048.0, 0.9), (4096.0, 1.04), (8192.0, 1.3), (16384.0, 1.8))
"""Per-token time of a packed task by its local tokens, relative: the shape the profiler
measured on a 2-core x86 VM (activations leave the caches beyond ~2k tokens per task)."""


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def cpu_start(local_ranks: int = 1) -> Hardware:
    """An uncalibrated CPU: one core's fp32 rates, gloo over loopback, the host's memory shared
    by ``local_ranks`` processes. Meant to be corrected by the online calibration."""
    local_ranks = max(1, int(local_ranks))
    return Hardware(
        name="cpu-auto", peak_flops=5e10, linear_flops=5e10, attention_flops=1.5e10,
        ring_attention_flops=1e10, hybrid_attention_flops=1e10,
        hbm_bytes=_host_memory_bytes() / local_ranks, hbm_bandwidth=2e10,
        intra_bandwidth=1e8, intra_latency=5e-4, inter_bandwidth=1e8, inter_latency=5e-4,
        ranks_per_node=local_ranks, token_overhead_s=2e-5, task_overhead_s=5e-3,
        pack_curve=CPU_PACK_CURVE, pack_tokens=2048, comm_overlap=0.0, communicator_bytes=0.0,
        reserve_bytes=0.0)


def _gemm_flops(device: torch.device, size: int = 4096, repeats: int = 10) -> float:
    """Measured bf16 GEMM FLOP/s on ``device`` (about a quarter of a second)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2.0 * size**3 * repeats / (time.perf_counter() - t0)


def preset_for_device_name(name: str) -> Optional[Hardware]:
    """The preset whose name appears in a CUDA device name (``NVIDIA H200`` -> h200)."""
    upper = name.upper()
    for key, hw in PRESETS.items():
        if key.upper() in upper:
            return hw
    return None


def detect_hardware(device: Optional[torch.device] = None, *, group: Any = None,
                    local_ranks: Optional[int] = None) -> Hardware:
    """The starting hardware of a run on ``device`` (module doc). ``group``: the ranks that
    must agree on a measured GPU rate (a MIN all-reduce; default: the world when initialised).
    ``local_ranks``: processes sharing this host (default ``LOCAL_WORLD_SIZE`` or 1)."""
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device is None or torch.device(device).type != "cuda":
        return cpu_start(local_ranks)
    device = torch.device(device)
    preset = preset_for_device_name(torch.cuda.get_device_name(device))
    if preset is not None:
        return preset
    rate = torch.tensor([_gemm_flops(device)], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(rate, op=dist.ReduceOp.MIN, group=group)
    base = PRESETS["h100"]
    factor = float(rate[0]) / base.linear_flops
    total = torch.cuda.get_device_properties(device).total_memory
    return replace(base, name=f"cuda-auto ({torch.cuda.get_device_name(device)})",
                   peak_flops=base.peak_flops * factor, linear_flops=float(rate[0]),
                   attention_flops=base.attention_flops * factor,
                   ring_attention_flops=base.ring_attention_flops * factor,
                   hybrid_attention_flops=base.hybrid_attention_flops * factor,
                   hbm_bytes=float(total))
