"""`Hardware`: what the cost model needs to know about one accelerator and its links.

Presets ``h200``, ``h100``, ``a100`` come from vendor data sheets (peak numbers) and commonly
reported achievable fractions (see the comment beside each number). Any other machine, ``cpu``
included, is described by a *profile JSON* that ``tools/profile.py`` writes after measuring it.

Profile JSON format (version 1; every field optional except ``name``; missing fields are taken
from ``"base"``, a preset name, when given, else an error names the missing field)::

    {
      "format_version": 1,
      "name": "my-cluster",            # free text
      "base": "h100",                  # optional preset to start from
      "peak_flops": 9.89e14,           # dense bf16 FLOP/s per rank (data sheet)
      "linear_flops": 6.0e14,          # measured FLOP/s of the model's GEMMs (achievable)
      "attention_flops": 4.5e14,       # measured FLOP/s of the attention kernel (fwd+bwd average)
      "hbm_bytes": 8.0e10,             # device memory per rank, bytes
      "hbm_bandwidth": 3.35e12,        # device memory bandwidth, bytes/s
      "intra_bandwidth": 3.0e11,       # achievable per-rank all-to-all / P2P bytes/s inside a node
      "intra_latency": 5e-6,           # per-collective latency inside a node, s
      "inter_bandwidth": 4.0e10,       # achievable per-rank bandwidth between nodes, bytes/s
      "inter_latency": 1.5e-5,         # per-collective latency between nodes, s
      "ranks_per_node": 8,
      "token_overhead_s": null,        # measured seconds per token per layer of non-GEMM work
                                       # (norms, rotary, activation, loss), fwd+bwd; null: analytic
      "task_overhead_s": null,         # measured fixed seconds per task (micro-step) besides
                                       # weight streaming: kernel launches, hooks; null: analytic
      "pack_curve": null,              # [[tokens, factor], ...]: factor on the per-token (GEMM,
                                       # element-wise) time of a task with that many local
                                       # tokens (CPUs slow down once activations leave the
                                       # caches); null: flat (GPUs)
      "comm_overlap": 1.0,             # share of ring traffic hidden behind attention (0: CPU)
      "pack_tokens": null,             # tokens of a packed task with the best measured
                                       # throughput: the planner's pack budget when the config
                                       # sets none; null: no budget (memory and time decide)
      "measured": {...}                # free-form raw measurements, kept but not used
    }

All bandwidths are *per rank*, in bytes per second, one direction.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

HARDWARE_FORMAT_VERSION = 1


class HardwareError(ValueError):
    """An unknown hardware preset or a malformed hardware profile."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator type, its memory and its links (per rank, one direction)."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s per rank from the data sheet (used for MFU)."""
    linear_flops: float
    """Achievable FLOP/s of the model's matrix multiplications."""
    attention_flops: float
    """Achievable FLOP/s of the (flash) attention kernel, forward and backward averaged."""
    hbm_bytes: float
    """Device memory per rank, bytes."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s (weight streaming, element-wise work)."""
    intra_bandwidth: float
    """Achievable per-rank collective bandwidth inside a node (NVLink), bytes/s."""
    intra_latency: float
    """Latency of one collective / P2P step inside a node, seconds."""
    inter_bandwidth: float
    """Achievable per-rank collective bandwidth between nodes (InfiniBand/RoCE), bytes/s."""
    inter_latency: float
    """Latency of one collective / P2P step between nodes, seconds."""
    ranks_per_node: int = 8
    token_overhead_s: Optional[float] = None
    """Measured non-GEMM seconds per token per layer (fwd+bwd); ``None``: analytic estimate."""
    task_overhead_s: Optional[float] = None
    """Measured fixed seconds per task besides weight streaming; ``None``: analytic estimate."""
    pack_curve: Optional[tuple] = None
    """``((tokens, factor), ...)``, tokens ascending: the cost model's GEMM and element-wise time of
    a task with that many local tokens is multiplied by the factor (interpolated in log tokens,
    constant beyond the ends). ``None``: per-token time does not depend on the task size."""
    pack_tokens: Optional[int] = None
    """Packed-task size (tokens) with the best measured throughput: the planner's pack budget
    when ``DCPConfig.pack_tokens`` is not set. ``None``: no budget."""
    comm_overlap: float = 1.0
    """Share of ring P2P traffic hidden behind attention: 1 where transfers run beside the
    compute (NCCL on its own stream), 0 where they take the compute's cores (gloo on a CPU)."""
    measured: dict = field(default_factory=dict, compare=False, hash=False)
    """Raw measurements of a profile (informational)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in _OPTIONAL:
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise HardwareError(f"hardware {self.name!r}: {f.name}={value!r} must be a "
                                    "positive number")
        if int(self.ranks_per_node) != self.ranks_per_node:
            raise HardwareError(f"hardware {self.name!r}: ranks_per_node must be an integer")
        for key in ("token_overhead_s", "task_overhead_s"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise HardwareError(f"hardware {self.name!r}: {key}={value!r} must be >= 0 or null")
        if self.pack_tokens is not None and (not isinstance(self.pack_tokens, int)
                                             or isinstance(self.pack_tokens, bool)
                                             or self.pack_tokens < 1):
            raise HardwareError(f"hardware {self.name!r}: pack_tokens={self.pack_tokens!r} must be "
                                "a positive integer or null")
        if not (isinstance(self.comm_overlap, (int, float)) and 0 <= self.comm_overlap <= 1):
            raise HardwareError(f"hardware {self.name!r}: comm_overlap={self.comm_overlap!r} must "
                                "be between 0 and 1")
        if self.pack_curve is not None:
            object.__setattr__(self, "pack_curve", _curve(self.pack_curve, self.name))

    def pack_factor(self, tokens: float) -> float:
        """Factor on the per-token time of a task with ``tokens`` local tokens (1.0 without a
        ``pack_curve``)."""
        curve = self.pack_curve
        if not curve or tokens <= curve[0][0]:
            return curve[0][1] if curve else 1.0
        if tokens >= curve[-1][0]:
            return curve[-1][1]
        for (t0, f0), (t1, f1) in zip(curve, curve[1:]):
            if tokens <= t1:
                w = math.log(tokens / t0) / math.log(t1 / t0)
                return f0 + w * (f1 - f0)
        return curve[-1][1]  # not reached

    def to_dict(self) -> dict[str, Any]:
        """The profile JSON form of this hardware."""
        data = {"format_version": HARDWARE_FORMAT_VERSION, **asdict(self)}
        if self.pack_curve is not None:
            data["pack_curve"] = [list(p) for p in self.pack_curve]
        return data


_OPTIONAL = ("name", "measured", "token_overhead_s", "task_overhead_s", "pack_curve", "pack_tokens",
             "comm_overlap")
"""Fields that may be ``None`` or are not positive numbers."""


def _curve(points: Any, name: str) -> tuple:
    """``pack_curve`` checked: ((tokens, factor), ...), tokens ascending."""
    where = f"hardware {name!r}: pack_curve"
    try:
        pts = sorted((float(t), float(f)) for t, f in points)
    except (TypeError, ValueError):
        raise HardwareError(f"{where} must be a list of [tokens, factor] pairs, got "
                            f"{points!r}") from None
    if not pts or any(not (t >= 1 and f > 0 and math.isfinite(f)) for t, f in pts):
        raise HardwareError(f"{where}: needs at least one point with tokens >= 1 and factor > 0, "
                            f"got {points!r}")
    if len({t for t, _ in pts}) != len(pts):
        raise HardwareError(f"{where}: tokens must be distinct, got {points!r}")
    return tuple(pts)


# Achievable fractions: dense GEMMs of a 7B-70B model reach 60-65 % of peak on Hopper (Megatron-LM
# and NVIDIA NeMo performance reports give 45-55 % MFU end to end); FlashAttention-2/3 reach about
# 50-60 % of peak forward and less backward (Dao 2023; Shah et al. 2024, FlashAttention-3), so 45 %
# averaged. NVLink all-to-all reaches about 2/3 of the unidirectional link rate (nccl-tests).
PRESETS: dict[str, Hardware] = {
    "h200": Hardware(
        name="h200",
        peak_flops=989e12,  # NVIDIA H200 SXM data sheet: 989 TFLOPS dense BF16
        linear_flops=989e12 * 0.62,
        attention_flops=989e12 * 0.45,
        hbm_bytes=141e9,  # data sheet: 141 GB HBM3e
        hbm_bandwidth=4.8e12,  # data sheet: 4.8 TB/s
        intra_bandwidth=300e9,
        # NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction, ~2/3 achieved
        intra_latency=5e-6,  # nccl-tests small-message latency inside an HGX node
        inter_bandwidth=40e9,  # 8x ConnectX-7 400 Gb/s per node = 50 GB/s per GPU, ~80 % achieved
        inter_latency=15e-6,  # InfiniBand NDR + NCCL protocol latency
        ranks_per_node=8,  # HGX H200: 8 GPUs per node
    ),
    "h100": Hardware(
        name="h100",
        peak_flops=989e12,  # NVIDIA H100 SXM data sheet: 989 TFLOPS dense BF16
        linear_flops=989e12 * 0.62,
        attention_flops=989e12 * 0.45,
        hbm_bytes=80e9,  # data sheet: 80 GB HBM3
        hbm_bandwidth=3.35e12,  # data sheet: 3.35 TB/s
        intra_bandwidth=300e9,  # NVLink 4: 450 GB/s per direction, ~2/3 achieved
        intra_latency=5e-6,
        inter_bandwidth=40e9,  # 8x 400 Gb/s per node (DGX H100) = 50 GB/s per GPU
        inter_latency=15e-6,
        ranks_per_node=8,
    ),
    "a100": Hardware(
        name="a100",
        peak_flops=312e12,  # NVIDIA A100 SXM data sheet: 312 TFLOPS dense BF16
        linear_flops=312e12 * 0.65,
        attention_flops=312e12 * 0.50,  # FlashAttention-2 paper: 50-73 % fwd, less bwd on A100
        hbm_bytes=80e9,  # A100 80GB
        hbm_bandwidth=2.039e12,  # data sheet: 2,039 GB/s
        intra_bandwidth=200e9,
        # NVLink 3: 600 GB/s bidirectional = 300 per direction, ~2/3 achieved
        intra_latency=6e-6,
        inter_bandwidth=20e9,  # DGX A100: 8x HDR 200 Gb/s = 25 GB/s per GPU, ~80 % achieved
        inter_latency=15e-6,
        ranks_per_node=8,
    ),
}


def load_hardware(name_or_path: "str | Hardware") -> Hardware:
    """A preset by name (``h200``, ``h100``, ``a100``) or a profile JSON file (see module doc)."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    if not isinstance(name_or_path, str) or not name_or_path:
        raise HardwareError("hardware must be a preset name or a profile JSON path, got "
                            f"{name_or_path!r}")
    key = name_or_path.lower()
    if key in PRESETS:
        return PRESETS[key]
    if key.endswith(".json") or os.path.sep in name_or_path or os.path.exists(name_or_path):
        return _load_profile(name_or_path)
    raise HardwareError(
        f"unknown hardware {name_or_path!r}: use a preset ({', '.join(PRESETS)}) or the path of a "
        "profile JSON written by tools/profile.py"
    )


def _load_profile(path: str) -> Hardware:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise HardwareError(f"hardware profile {path!r} does not exist") from None
    except (OSError, json.JSONDecodeError) as err:
        raise HardwareError(f"hardware profile {path!r} is not readable JSON: {err}") from None
    return hardware_from_dict(data, where=path)


def hardware_from_dict(data: dict[str, Any], where: str = "hardware profile") -> Hardware:
    """Build a `Hardware` from the profile JSON object (see module doc)."""
    if not isinstance(data, dict):
        raise HardwareError(f"{where}: the profile must be a JSON object")
    version = data.get("format_version", HARDWARE_FORMAT_VERSION)
    if version != HARDWARE_FORMAT_VERSION:
        raise HardwareError(f"{where}: format_version {version} is not supported (expected 1)")
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known - {"format_version", "base"})
    if unknown:
        raise HardwareError(f"{where}: unknown key(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    base = data.get("base")
    if base is not None:
        if str(base).lower() not in PRESETS:
            raise HardwareError(f"{where}: unknown base preset {base!r} (presets: "
                                f"{', '.join(PRESETS)})")
        values.update(asdict(PRESETS[str(base).lower()]))
    values.update({k: v for k, v in data.items() if k in known})
    values.setdefault("name", os.path.basename(where))
    missing = sorted(f.name for f in fields(Hardware) if f.name not in values
                     and f.name not in ("ranks_per_node", *_OPTIONAL))
    if missing:
        raise HardwareError(f"{where}: missing field(s) {', '.join(missing)} (or give \"base\": a "
                            "preset)")
    return Hardware(**values)
