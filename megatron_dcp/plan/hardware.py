"""`Hardware`: what the cost model needs to know about one accelerator and its links.

Presets ``h200``, ``h100``, ``a100`` come from vendor data sheets (peak numbers) and commonly
reported achievable fractions (see the comment beside each number). Any other machine, ``cpu``
included, is described by a *profile JSON* that ``tools/profile_hardware.py`` writes after
measuring it.

Profile JSON format (version 1; every field optional except ``name``; missing fields are taken
from ``"base"``, a preset name, when given, else an error names the missing field)::

    {
      "format_version": 1,
      "name": "my-cluster",            # free text
      "base": "h100",                  # optional preset to start from
      "peak_flops": 9.89e14,           # dense bf16 FLOP/s per rank (data sheet)
      "linear_flops": 6.0e14,          # measured FLOP/s of the model's GEMMs (achievable)
      "attention_flops": 4.5e14,       # measured FLOP/s of local attention (degree 1 and
                                       # Ulysses: one kernel call per task), fwd+bwd average
      "ring_attention_flops": null,    # the same for ring tasks (blocks merged by log-sum-exp);
                                       # null: attention_flops
      "hybrid_attention_flops": null,  # the same for Ulysses x ring tasks; null: attention_flops
      "hbm_bytes": 8.0e10,             # device memory per rank, bytes
      "hbm_bandwidth": 3.35e12,        # device memory bandwidth, bytes/s
      "intra_bandwidth": 3.0e11,       # achievable per-rank all-to-all / P2P bytes/s inside a node
      "intra_latency": 5e-6,           # per-collective latency inside a node, s
      "inter_bandwidth": 4.0e10,       # achievable per-rank bandwidth between nodes, bytes/s
      "inter_latency": 1.5e-5,         # per-collective latency between nodes, s
      "ranks_per_node": 8,
      "communicator_bytes": 0,         # device memory of a communicator's all-reduce, bytes
      "connection_bytes": null,        # device memory of one send/receive connection (a peer
                                       # in one direction, all channels); null: every
                                       # communicator charged communicator_bytes
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
      "reserve_bytes": null,           # memory per rank the planner leaves alone; null: 4e9
      "calibration": null,             # {term: factor}: factors on the cost model's terms
                                       # fitted online from measured step times (`--dcp_calibration`):
                                       # linear, attention_local, attention_ring,
                                       # attention_hybrid, all_to_all, p2p, tensor_parallel,
                                       # per_token, per_task; null or missing terms: 1
      "step_overhead_s": null,         # measured seconds per step besides the tasks (gradient
                                       # reduction, optimizer, planning); null: analytic
      "measured": {...}                # free-form raw measurements, kept but not used
    }

All bandwidths are *per rank*, in bytes per second, one direction. Every number must be finite
(JSON's ``NaN`` and ``Infinity`` are rejected, naming the field and the file). A profile that
sets ``attention_flops`` but not the ring/hybrid rates uses its own local rate for them (not the
base preset's), so profiles written before those fields existed keep their meaning.
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


def layout_kind(ulysses: int, ring: int) -> str:
    """``local`` (one rank, or Ulysses: one attention call per task), ``ring`` or ``hybrid``."""
    if ring == 1:
        return "local"
    return "ring" if ulysses == 1 else "hybrid"


@dataclass(frozen=True)
class Hardware:
    """One accelerator type, its memory and its links (per rank, one direction)."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s per rank from the data sheet (used for MFU)."""
    linear_flops: float
    """Achievable FLOP/s of the model's matrix multiplications."""
    attention_flops: float
    """Achievable FLOP/s of local attention (degree 1, and Ulysses after its all-to-all: one
    kernel call over the task's packed sequences), forward and backward averaged."""
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
    ring_attention_flops: Optional[float] = None
    """Achievable attention FLOP/s inside ring tasks (one kernel call per ring step on a block,
    blocks merged by log-sum-exp); ``None``: ``attention_flops``."""
    hybrid_attention_flops: Optional[float] = None
    """Achievable attention FLOP/s inside Ulysses x ring tasks; ``None``: ``attention_flops``."""
    communicator_bytes: float = 0.0
    """Device memory the buffers of a communicator's all-reduce (ring and tree channels) take,
    bytes: the planner charges every rank for the communicators of the group vocabulary it
    belongs to by the collectives run on them (`megatron_dcp.plan.vocabulary.Vocabulary.charge`).
    0 for gloo (host memory, small)."""
    connection_bytes: Optional[float] = None
    """Device memory of one NCCL send/receive connection (one peer, one direction, all its
    channels), bytes: Ulysses' all-to-all sets up two for every other member of its group, the
    ring two. ``None`` (a profile with one figure per communicator): every communicator is
    charged ``communicator_bytes``, whatever it runs."""
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
    reserve_bytes: Optional[float] = None
    """Memory per rank the planner leaves alone (CUDA context, the engine's communicators,
    fragmentation); ``None``: `megatron_dcp.plan.memory.RESERVE_BYTES` (4 GB, GPUs)."""
    calibration: Optional[tuple] = None
    """``((term, factor), ...)``: factors on the cost model's terms (`CALIBRATED_TERMS`), fitted
    online from measured step times (`megatron_dcp.plan.calibration`); ``None``: all 1."""
    step_overhead_s: Optional[float] = None
    """Measured seconds per step besides the tasks (gradient reduction, optimizer step,
    planning); ``None``: the cost model's analytic `TimeModel.sync_time`."""
    host_link_bandwidth: Optional[float] = None
    """Achievable bytes/s per GPU, each direction, between device and pinned host memory (PCIe):
    the rate activation offload (`megatron_dcp.runtime.offload`) moves layer inputs at; ``None``:
    `megatron_dcp.plan.memory.HOST_LINK_BANDWIDTH`."""
    measured: dict = field(default_factory=dict, compare=False, hash=False)
    """Raw measurements of a profile (informational)."""

    def __post_init__(self) -> None:
        for key in _POSITIVE:
            _check(self, key, lower=0.0, strict=True, optional=False)
        for key in _POSITIVE_OR_NULL:
            _check(self, key, lower=0.0, strict=True, optional=True)
        for key in _NON_NEGATIVE_OR_NULL:
            _check(self, key, lower=0.0, strict=False, optional=True)
        _check(self, "communicator_bytes", lower=0.0, strict=False, optional=False)
        _check(self, "comm_overlap", lower=0.0, strict=False, optional=False)
        if self.comm_overlap > 1:
            raise HardwareError(f"hardware {self.name!r}: comm_overlap={self.comm_overlap!r} must "
                                "be between 0 and 1")
        if int(self.ranks_per_node) != self.ranks_per_node:
            raise HardwareError(f"hardware {self.name!r}: ranks_per_node={self.ranks_per_node!r} "
                                "must be an integer")
        if self.pack_tokens is not None and (not isinstance(self.pack_tokens, int)
                                             or isinstance(self.pack_tokens, bool)
                                             or self.pack_tokens < 1):
            raise HardwareError(f"hardware {self.name!r}: pack_tokens={self.pack_tokens!r} must be "
                                "a positive integer or null")
        if self.pack_curve is not None:
            object.__setattr__(self, "pack_curve", _curve(self.pack_curve, self.name))
        if self.calibration is not None:
            object.__setattr__(self, "calibration", _calibration(self.calibration, self.name))

    def scale(self, term: str) -> float:
        """The calibration factor of one of `CALIBRATED_TERMS` (1.0 when not calibrated)."""
        for name, factor in self.calibration or ():
            if name == term:
                return factor
        return 1.0

    def attention_rate(self, ulysses: int, ring: int) -> float:
        """Achievable attention FLOP/s of a task with this layout (see `layout_kind`)."""
        kind = layout_kind(ulysses, ring)
        if kind == "ring" and self.ring_attention_flops is not None:
            return self.ring_attention_flops
        if kind == "hybrid" and self.hybrid_attention_flops is not None:
            return self.hybrid_attention_flops
        return self.attention_flops

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
        if self.calibration is not None:
            data["calibration"] = dict(self.calibration)
        return data


_POSITIVE = ("peak_flops", "linear_flops", "attention_flops", "hbm_bytes", "hbm_bandwidth",
             "intra_bandwidth", "intra_latency", "inter_bandwidth", "inter_latency",
             "ranks_per_node")
"""Fields that must be finite numbers > 0."""
_POSITIVE_OR_NULL = ("ring_attention_flops", "hybrid_attention_flops")
_NON_NEGATIVE_OR_NULL = ("token_overhead_s", "task_overhead_s", "step_overhead_s",
                         "reserve_bytes", "connection_bytes")
_OPTIONAL = ("name", "measured", "ranks_per_node", "ring_attention_flops",
             "hybrid_attention_flops", "communicator_bytes", "connection_bytes",
             "token_overhead_s",
             "task_overhead_s", "pack_curve", "pack_tokens", "comm_overlap", "calibration",
             "step_overhead_s", "reserve_bytes", "host_link_bandwidth")
"""Fields a profile without a ``base`` may leave out."""


def _check(hw: Hardware, key: str, *, lower: float, strict: bool, optional: bool) -> None:
    """``hw.key`` is a finite number above (``strict``) or at least ``lower`` (or ``None`` when
    ``optional``). NaN fails every comparison, so it is checked by name, not by ``value < 0``:
    a NaN that got through once made the planner's list scheduler spin forever."""
    value = getattr(hw, key)
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < lower or (strict and value == lower):
        bound = f"> {lower:g}" if strict else f">= {lower:g}"
        null = " or null" if optional else ""
        raise HardwareError(f"hardware {hw.name!r}: {key}={value!r} must be a finite number "
                            f"{bound}{null}")


CALIBRATED_TERMS = ("linear", "attention_local", "attention_ring", "attention_hybrid",
                    "all_to_all", "p2p", "tensor_parallel", "per_token", "per_task")
"""The cost model's terms a calibration scales (`megatron_dcp.plan.timing.Terms`): ``linear`` the
GEMMs and weight streaming, ``attention_<layout kind>`` the attention kernels of each layout
(`layout_kind`), ``all_to_all`` / ``p2p`` / ``tensor_parallel`` the communication with its
latency, ``per_token`` the element-wise work, ``per_task`` the fixed cost of a task."""


def _calibration(value: Any, name: str) -> tuple:
    """``calibration`` checked: ((term, factor), ...) in `CALIBRATED_TERMS` order."""
    where = f"hardware {name!r}: calibration"
    try:
        items = dict(value.items() if isinstance(value, dict) else value)
    except (TypeError, ValueError):
        raise HardwareError(f"{where} must map terms to factors, got {value!r}") from None
    unknown = sorted(str(k) for k in items if k not in CALIBRATED_TERMS)
    if unknown:
        raise HardwareError(f"{where}: unknown term(s) {', '.join(unknown)}; terms: "
                            f"{', '.join(CALIBRATED_TERMS)}")
    for term, factor in items.items():
        number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
        if not number or not math.isfinite(factor) or factor <= 0:
            raise HardwareError(f"{where}: {term}={factor!r} must be a finite number > 0")
    return tuple((t, float(items[t])) for t in CALIBRATED_TERMS if t in items)


def _curve(points: Any, name: str) -> tuple:
    """``pack_curve`` checked: ((tokens, factor), ...), tokens ascending."""
    where = f"hardware {name!r}: pack_curve"
    try:
        pts = sorted((float(t), float(f)) for t, f in points)
    except (TypeError, ValueError):
        raise HardwareError(f"{where} must be a list of [tokens, factor] pairs, got "
                            f"{points!r}") from None
    finite = all(math.isfinite(t) and math.isfinite(f) for t, f in pts)
    if not pts or not finite or any(not (t >= 1 and f > 0) for t, f in pts):
        raise HardwareError(f"{where}: needs at least one point with finite tokens >= 1 and "
                            f"factor > 0, got {points!r}")
    if len({t for t, _ in pts}) != len(pts):
        raise HardwareError(f"{where}: tokens must be distinct, got {points!r}")
    return tuple(pts)


# Achievable fractions: dense GEMMs of a 7B-70B model reach 60-65 % of peak on Hopper (Megatron-LM
# and NVIDIA NeMo performance reports give 45-55 % MFU end to end); FlashAttention-2/3 reach about
# 50-60 % of peak forward and less backward (Dao 2023; Shah et al. 2024, FlashAttention-3), so 45 %
# averaged. NVLink all-to-all reaches about 2/3 of the unidirectional link rate (nccl-tests).
#
# Ring tasks run attention as one kernel call per ring step on a block of the sequence, merged by
# log-sum-exp: smaller calls, a merge per step and (backward) a second pass per step. The public
# zigzag ring of ring-flash-attention (varlen, forward+backward, Llama-3-8B heads, 8k tokens per
# GPU) reaches 75.9 % of one flash varlen call over the same work on 8 x H800 and 80.2 % on
# 8 x A100 (its README's benchmark table): RING_SHARE. A Ulysses x ring task runs the same blocks
# over fewer ring steps (ring degree d / u) with u times more tokens per block, so its per-step
# losses weigh about half as much: HYBRID_SHARE, midway between ring and one call (an estimate,
# not a measurement; `tools/profile_hardware.py` measures all three where ranks allow).
HOPPER_RING_SHARE, HOPPER_HYBRID_SHARE = 0.76, 0.88
AMPERE_RING_SHARE, AMPERE_HYBRID_SHARE = 0.80, 0.90
# NCCL allocates per communicator, per channel and per connected peer a FIFO for each protocol
# (4 MiB for Simple by default, plus LL and LL128), and sets connections up lazily (NCCL >= 2.22):
# only for the collectives a communicator runs. An all-reduce connects a ring (two peers) and a
# tree per channel: measured with PyTorch on 4 x A100 NVLink after one all-reduce, 544 MB for a
# group of 2 GPUs, 688 MB for larger groups (NCCL issue #964); Hopper runs more channels: 0.5 GB.
# Send/receive (Ulysses' all-to-all, the ring's exchange) connects each peer on up to 32 channels
# inside an NVLink node: one all_to_all_single over 8 x H100 took 3.28 GB a GPU (1.06 -> 4.34 GB,
# NCCL issue #1685), 14 connections (7 peers, both ways): 0.234 GB a connection. Across nodes NCCL
# uses 2 channels a network peer (NCCL_NCHANNELS_PER_NET_PEER), and gives every peer of a
# communicator the least count over its peers: in one that spans nodes, NVLink peers get 2 too
# (megatron_dcp.plan.vocabulary.NET_CONNECTION_SHARE).
NCCL_CONNECTION_BYTES = 3.28e9 / 14
NCCL_COMMUNICATOR_BYTES = 0.5e9

_H_PEAK, _A_PEAK = 989e12, 312e12
PRESETS: dict[str, Hardware] = {
    "h200": Hardware(
        name="h200",
        peak_flops=_H_PEAK,  # NVIDIA H200 SXM data sheet: 989 TFLOPS dense BF16
        linear_flops=_H_PEAK * 0.62,
        attention_flops=_H_PEAK * 0.45,
        ring_attention_flops=_H_PEAK * 0.45 * HOPPER_RING_SHARE,
        hybrid_attention_flops=_H_PEAK * 0.45 * HOPPER_HYBRID_SHARE,
        hbm_bytes=141e9,  # data sheet: 141 GB HBM3e
        hbm_bandwidth=4.8e12,  # data sheet: 4.8 TB/s
        intra_bandwidth=300e9,
        # NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction, ~2/3 achieved
        intra_latency=5e-6,  # nccl-tests small-message latency inside an HGX node
        inter_bandwidth=40e9,  # 8x ConnectX-7 400 Gb/s per node = 50 GB/s per GPU, ~80 % achieved
        inter_latency=15e-6,  # InfiniBand NDR + NCCL protocol latency
        ranks_per_node=8,  # HGX H200: 8 GPUs per node
        communicator_bytes=NCCL_COMMUNICATOR_BYTES, connection_bytes=NCCL_CONNECTION_BYTES,
        host_link_bandwidth=50e9,  # PCIe Gen5 x16: 64 GB/s per direction, ~80 % achieved
    ),
    "h100": Hardware(
        name="h100",
        peak_flops=_H_PEAK,  # NVIDIA H100 SXM data sheet: 989 TFLOPS dense BF16
        linear_flops=_H_PEAK * 0.62,
        attention_flops=_H_PEAK * 0.45,
        ring_attention_flops=_H_PEAK * 0.45 * HOPPER_RING_SHARE,
        hybrid_attention_flops=_H_PEAK * 0.45 * HOPPER_HYBRID_SHARE,
        hbm_bytes=80e9,  # data sheet: 80 GB HBM3
        hbm_bandwidth=3.35e12,  # data sheet: 3.35 TB/s
        intra_bandwidth=300e9,  # NVLink 4: 450 GB/s per direction, ~2/3 achieved
        intra_latency=5e-6,
        inter_bandwidth=40e9,  # 8x 400 Gb/s per node (DGX H100) = 50 GB/s per GPU
        inter_latency=15e-6,
        ranks_per_node=8,
        communicator_bytes=NCCL_COMMUNICATOR_BYTES, connection_bytes=NCCL_CONNECTION_BYTES,
        host_link_bandwidth=50e9,  # PCIe Gen5 x16: 64 GB/s per direction, ~80 % achieved
    ),
    "a100": Hardware(
        name="a100",
        peak_flops=_A_PEAK,  # NVIDIA A100 SXM data sheet: 312 TFLOPS dense BF16
        linear_flops=_A_PEAK * 0.65,
        attention_flops=_A_PEAK * 0.50,  # FlashAttention-2 paper: 50-73 % fwd, less bwd on A100
        ring_attention_flops=_A_PEAK * 0.50 * AMPERE_RING_SHARE,
        hybrid_attention_flops=_A_PEAK * 0.50 * AMPERE_HYBRID_SHARE,
        hbm_bytes=80e9,  # A100 80GB
        hbm_bandwidth=2.039e12,  # data sheet: 2,039 GB/s
        intra_bandwidth=200e9,
        # NVLink 3: 600 GB/s bidirectional = 300 per direction, ~2/3 achieved
        intra_latency=6e-6,
        inter_bandwidth=20e9,  # DGX A100: 8x HDR 200 Gb/s = 25 GB/s per GPU, ~80 % achieved
        inter_latency=15e-6,
        ranks_per_node=8,
        communicator_bytes=NCCL_COMMUNICATOR_BYTES, connection_bytes=NCCL_CONNECTION_BYTES,
        host_link_bandwidth=25e9,  # PCIe Gen4 x16: 32 GB/s per direction, ~80 % achieved
    ),
}


AUTO = "auto"
"""``DCPConfig.hardware`` default: the runtime picks the hardware of the device it runs on
(`megatron_dcp.runtime.hardware_auto`); planning offline (simulator, `make_plan` without a
device) uses `OFFLINE_DEFAULT`."""
OFFLINE_DEFAULT = "h200"


def load_hardware(name_or_path: "str | Hardware") -> Hardware:
    """A preset by name (``h200``, ``h100``, ``a100``; ``auto`` offline: `OFFLINE_DEFAULT`) or a
    profile JSON file (see module doc)."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    if not isinstance(name_or_path, str) or not name_or_path:
        raise HardwareError("hardware must be a preset name or a profile JSON path, got "
                            f"{name_or_path!r}")
    key = name_or_path.lower()
    if key in PRESETS:
        return PRESETS[key]
    if key == AUTO:
        return PRESETS[OFFLINE_DEFAULT]
    if key.endswith(".json") or os.path.sep in name_or_path or os.path.exists(name_or_path):
        return _load_profile(name_or_path)
    raise HardwareError(
        f"unknown hardware {name_or_path!r}: use a preset ({', '.join(PRESETS)}) or the path of a "
        "profile JSON written by tools/profile_hardware.py"
    )


def _load_profile(path: str) -> Hardware:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise HardwareError(f"hardware profile {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HardwareError(f"hardware profile {path!r} is not readable JSON: {err}") from None
    except RecursionError:  # Python's JSON reader on nesting deeper than its stack
        raise HardwareError(f"hardware profile {path!r} is not readable JSON: nested too "
                            "deeply") from None
    return hardware_from_dict(data, where=path)


def hardware_from_dict(data: dict[str, Any], where: str = "hardware profile") -> Hardware:
    """Build a `Hardware` from the profile JSON object (see module doc); errors name ``where``."""
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
        if "attention_flops" in data:
            # a measured local rate without measured ring/hybrid rates: those follow it (not the
            # base preset's numbers, which belong to another attention rate)
            for key in ("ring_attention_flops", "hybrid_attention_flops"):
                values[key] = None
    values.update({k: v for k, v in data.items() if k in known})
    values.setdefault("name", os.path.basename(where))
    missing = sorted(f.name for f in fields(Hardware) if f.name not in values
                     and f.name not in _OPTIONAL)
    if missing:
        raise HardwareError(f"{where}: missing field(s) {', '.join(missing)} (or give \"base\": a "
                            "preset)")
    try:
        return Hardware(**values)
    except HardwareError as err:
        raise HardwareError(f"{where}: {err}") from None
