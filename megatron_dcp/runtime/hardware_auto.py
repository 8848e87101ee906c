"""``--dcp_hardware auto``: the cost model's starting hardware for the device the run is on.

* CUDA: the preset of the device's model, matched by name precisely (`preset_for_device_name`:
  H100 SXM / PCIe / NVL, H200 / H200 NVL, GH200, A100 SXM / PCIe, 40 or 80 GB), with the
  device's real ``total_memory`` (a MIG slice, an 80 GB part in a 40 GB name) and the ranks per
  node of the launcher (``LOCAL_WORLD_SIZE``; else at most the visible GPUs) in place of the
  preset's. Any other GPU: the H100 preset with its compute rates scaled by a quick measured
  bf16 GEMM rate (a fraction of a second; the smallest over the ranks, so that every rank plans
  with the same numbers).
* CPU: `cpu_start`, an uncalibrated start (rates typical of one core of a server CPU, gloo's
  effective bandwidth, the pack curve CPUs show) that the online calibration corrects within a
  few steps (`megatron_dcp.plan.calibration`).

Every rank must resolve the same hardware: presets and the CPU start depend only on the device
kind and on the host's memory and local rank count; a measured GPU rate is reduced over ranks.
"""

from __future__ import annotations

import os
import re
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


# Variants of the presets (`megatron_dcp.plan.hardware.PRESETS`) by data sheet. PCIe cards
# talk to each other over PCIe (an NVLink bridge joins pairs at most, which a ring or Ulysses
# group of more than two cannot count on): Gen5 x16 64 GB/s per direction, Gen4 32 GB/s, ~80 %
# achieved.
_PCIE5, _PCIE4 = 50e9, 25e9
_VARIANTS: dict[str, tuple[str, dict]] = {
    # H100 PCIe: 756 TFLOPS dense BF16, 80 GB HBM2e at 2.0 TB/s
    "h100-pcie": ("h100", dict(peak_flops=756e12, hbm_bandwidth=2.0e12,
                               intra_bandwidth=_PCIE5)),
    # H100 NVL: 835 TFLOPS dense BF16 (1671 sparse), 94 GB HBM3 at 3.9 TB/s
    "h100-nvl": ("h100", dict(peak_flops=835e12, hbm_bytes=94e9, hbm_bandwidth=3.9e12,
                              intra_bandwidth=_PCIE5)),
    # H200 NVL: 835 TFLOPS dense BF16, 141 GB HBM3e at 4.8 TB/s
    "h200-nvl": ("h200", dict(peak_flops=835e12, intra_bandwidth=_PCIE5)),
    # GH200: the H100 SXM's compute, 96 GB HBM3 at 4 TB/s (the 144 GB HBM3e part: 4.9 TB/s);
    # one GPU per Grace superchip node unless the launcher says otherwise
    "gh200": ("h100", dict(hbm_bytes=96e9, hbm_bandwidth=4.0e12, ranks_per_node=1)),
    # A100 40GB SXM: 1,555 GB/s
    "a100-40gb": ("a100", dict(hbm_bytes=40e9, hbm_bandwidth=1.555e12)),
    # A100 PCIe: 40 GB at 1,555 GB/s or 80 GB at 1,935 GB/s; PCIe Gen4
    "a100-pcie-40gb": ("a100", dict(hbm_bytes=40e9, hbm_bandwidth=1.555e12,
                                    intra_bandwidth=_PCIE4)),
    "a100-pcie": ("a100", dict(hbm_bandwidth=1.935e12, intra_bandwidth=_PCIE4)),
}


def _preset(key: str) -> Hardware:
    if key in PRESETS:
        return PRESETS[key]
    base, changes = _VARIANTS[key]
    return replace(PRESETS[base], name=key, **changes)


def preset_key_for_device_name(name: str) -> Optional[str]:
    """The preset (or variant) key of a CUDA device name, matched as whole words
    (``NVIDIA GH200 480GB`` is not an H200; ``NVIDIA H100 PCIe`` not an SXM part)."""
    upper = name.upper()

    def word(w: str) -> bool:
        return re.search(rf"(?<![A-Z0-9]){w}(?![A-Z0-9])", upper) is not None

    pcie = word("PCIE")
    if word("GH200"):
        return "gh200"
    if word("H200"):
        return "h200-nvl" if word("NVL") else "h200"
    if word("H100"):
        return "h100-nvl" if word("NVL") else "h100-pcie" if pcie else "h100"
    if word("A100"):
        small = re.search(r"(?<![0-9])40 ?GB", upper) is not None
        if pcie:
            return "a100-pcie-40gb" if small else "a100-pcie"
        return "a100-40gb" if small else "a100"
    return None


def preset_for_device_name(name: str) -> Optional[Hardware]:
    """The preset of a CUDA device name (``NVIDIA H200`` -> h200), ``None`` for another GPU."""
    key = preset_key_for_device_name(name)
    return None if key is None else _preset(key)


def _ranks_per_node(local_ranks: Optional[int], default: int) -> int:
    """DCP ranks per node on CUDA: ``local_ranks`` (`ranks_per_node_of`: counted from the DCP
    world's own hosts), else the launcher's ``LOCAL_WORLD_SIZE``, else the preset's, at most
    the GPUs this process sees."""
    if local_ranks is not None:
        return max(1, int(local_ranks))
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env:
        return max(1, int(env))
    return max(1, min(int(default), torch.cuda.device_count() or int(default)))


def ranks_per_node_of(group: Any = None, hostname: Optional[str] = None) -> int:
    """DCP ranks per node, counted from the hosts of ``group``'s ranks (the DCP world, at
    start): the fewest consecutive ranks on one host, or 1 where a
    host's ranks are not consecutive. ``LOCAL_WORLD_SIZE`` counts the job's processes on a host,
    which is not this under tensor or pipeline parallelism (TP 8: one DCP rank per node) nor
    under launchers that give each process one GPU without it. One all-gather of an int64 a rank
    (a digest of the host name)."""
    import socket

    import hashlib

    from megatron_dcp.runtime.groups import comm_device

    me = hostname if hostname is not None else socket.gethostname()
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if dist.get_world_size(group) == 1:
        return 1
    # one int64 per rank (a digest of its host name): no object collective (no pickle, no numpy)
    key = int(hashlib.sha256(me.encode()).hexdigest()[:15], 16)
    mine = torch.tensor([key], dtype=torch.int64, device=comm_device(group))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    hosts = torch.cat(gathered).tolist()
    runs: list[list] = []
    for host in hosts:
        if runs and runs[-1][0] == host:
            runs[-1][1] += 1
        else:
            runs.append([host, 1])
    if len({host for host, _ in runs}) != len(runs):  # a host's ranks are not one block
        return 1
    return min(count for _, count in runs)


def _agreed_rate(rate: float, device: torch.device, group: Any) -> float:
    """The smallest ``rate`` over ``group`` (this rank's own when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return rate
    t = torch.tensor([rate], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return float(t[0])


def detect_hardware(device: Optional[torch.device] = None, *, group: Any = None,
                    local_ranks: Optional[int] = None) -> Hardware:
    """The starting hardware of a run on ``device`` (module doc). ``group``: the ranks that
    must agree on a measured GPU rate (a MIN all-reduce; default: the world when initialised).
    ``local_ranks``: processes sharing this host (default ``LOCAL_WORLD_SIZE``; on the CPU 1,
    on CUDA the preset's)."""
    if device is None or torch.device(device).type != "cuda":
        if local_ranks is None:
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return cpu_start(local_ranks)
    device = torch.device(device)
    props = torch.cuda.get_device_properties(device)
    preset = preset_for_device_name(props.name)
    if preset is None:
        base = PRESETS["h100"]
        rate = _agreed_rate(_gemm_flops(device), device, group)
        factor = rate / base.linear_flops
        preset = replace(base, name=f"cuda-auto ({props.name})",
                         peak_flops=base.peak_flops * factor, linear_flops=rate,
                         attention_flops=base.attention_flops * factor,
                         ring_attention_flops=base.ring_attention_flops * factor,
                         hybrid_attention_flops=base.hybrid_attention_flops * factor)
    return replace(preset, hbm_bytes=float(props.total_memory),
                   ranks_per_node=_ranks_per_node(local_ranks, preset.ranks_per_node))


def starting_hardware(config: Any, device: Optional[torch.device] = None,
                      pool: Any = None) -> Hardware:
    """``config.hardware`` (a `DCPConfig`'s) resolved on the job's device: ``device``, else the
    device the DCP world's collectives run on (``pool``'s world group: an NCCL job without a
    device starts from its GPU, not from host memory). ``auto``: by the device
    (`detect_hardware`). A preset or a profile on CUDA: with the DCP ranks per node counted
    from the DCP world's own hosts (`ranks_per_node_of`: a preset says 8 GPUs a node whatever
    tensor or pipeline parallelism takes of them; a profile, the ranks it was measured with),
    unless ``config.ranks_per_node`` sets them. Collective over the DCP world where it counts."""
    from megatron_dcp.plan.hardware import AUTO, load_hardware
    from megatron_dcp.runtime.groups import comm_device

    if device is None and pool is not None and dist.is_initialized():
        device = comm_device(pool.world_group)
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if config.hardware.lower() != AUTO:
        hardware = load_hardware(config.hardware)
        if on_cuda and pool is not None and config.ranks_per_node is None:
            hardware = replace(hardware, ranks_per_node=ranks_per_node_of(pool.world_group))
        return hardware
    group = getattr(pool, "job_group", None) if pool is not None else None
    # DCP ranks sharing a host, counted from the DCP world's own hosts
    local = ranks_per_node_of(pool.world_group) if pool is not None else 1
    return detect_hardware(device, group=group, local_ranks=local)
