"""`profile_hardware`: measure this machine and return a hardware profile (the JSON object of
`megatron_dcp.plan.hardware`, loaded by ``--hardware`` / ``dcp.hardware``).

What is measured (the cost model's terms, `megatron_dcp.plan.cost`):

* ``linear_flops``: FLOP/s of the reference decoder's GEMMs (its weight shapes, forward and
  backward), timed alone; ``peak_flops``: the same (no data sheet for a CPU; on a GPU the planner
  uses it only for MFU);
* ``attention_flops``, ``token_overhead_s``, ``task_overhead_s``: fitted to the forward+backward
  time of the whole reference decoder run as one-rank tasks (one sequence per length and
  number of recomputed layers, a 16-token task for the fixed per-task cost, and the packed
  tasks below);
* ``pack_curve`` / ``pack_tokens``: packed degree-1 tasks of ``pack_seq``-token sequences at
  several sizes: the GEMM and element-wise time per token relative to the cost model, and the
  largest size within ``PACK_TOLERANCE`` of the best throughput (the planner's pack budget);
* ``hbm_bandwidth``: a large tensor copy; ``hbm_bytes``: memory per rank;
* over ``ranks`` processes (gloo on CPU, NCCL with one GPU per rank): ``intra_bandwidth`` /
  ``intra_latency`` from all-to-alls (``latency + bytes / bandwidth``), lowered to what a real
  Ulysses task pays beyond its compute; ``ring_attention_flops`` from ring tasks of one sequence
  (every other number fixed: the rate at which the cost model predicts them), and
  ``hybrid_attention_flops`` from Ulysses-2 x ring tasks (4 ranks or more; with fewer, the ring
  rate: the same block kernels); ``communicator_bytes`` and ``connection_bytes`` (NCCL: device
  memory of a communicator's all-reduce and of one send/receive connection; gloo: 0);
* with a single GPU (NCCL cannot put two ranks on one device) the ring and hybrid rates are the
  documented shares of the measured local rate (`megatron_dcp.plan.hardware`), and a CPU without
  the communication test leaves them out (they follow ``attention_flops``);
* ``comm_overlap``: 0 on CPU (gloo's transfers take the cores the attention runs on), else 1.

Every raw measurement and the fit's per-point error are kept under ``"measured"``. One node:
the inter-node numbers are copies of the intra-node ones.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_dcp.models import Decoder, DecoderConfig
from megatron_dcp.plan.hardware import (AMPERE_HYBRID_SHARE, AMPERE_RING_SHARE,
                                        HOPPER_HYBRID_SHARE, HOPPER_RING_SHARE,
                                        NCCL_COMMUNICATOR_BYTES, NCCL_CONNECTION_BYTES,
                                        hardware_from_dict)
from megatron_dcp.profiling import fit, measure
from megatron_dcp.progress import Progress

MEASUREMENTS = ("GEMM", "copy", "model tasks", "packed tasks", "communication")
"""The measurements `profile_hardware` runs, in order (communication: with more than one
rank); a progress bar counts them."""


@dataclass
class ProfileSettings:
    """What to measure (the flags of ``tools/profile_hardware.py``)."""

    name: Optional[str] = None
    """Hardware name in the profile; default ``<device>-<host>-<threads>t``."""
    device: str = "cpu"
    """cpu or cuda."""
    dtype: Optional[str] = None
    """float32, bfloat16 or float16; default bfloat16 on CUDA (what training runs), else
    float32."""
    threads: int = 1
    """torch threads per process (CPU)."""
    ranks: int = 2
    """Processes of the communication and multi-rank task tests (and ranks per node in the
    profile); 0 or 1 skips them. On CUDA at most one per GPU."""
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    ffn: Optional[int] = None
    """MLP width; default: the reference decoder's for ``hidden``."""
    vocab: int = 1024
    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    """Sequence lengths of the one-rank model timings."""
    pack_sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384)
    """Packed-task sizes (tokens) of the pack curve; empty: no pack curve."""
    pack_seq: int = 256
    """Length of the short sequences packed into those tasks."""
    layout_lengths: tuple[int, ...] = (1024, 2048)
    """Sequence lengths of the ring and hybrid tasks."""
    repeat: int = 3
    concurrent: bool = False
    """Time the one-rank model in ``ranks`` processes at once (what a job's ranks see when they
    share a machine); default: one process alone."""
    quick: bool = False
    """A small grid (tests, the demo's first run)."""

    def resolved_dtype(self) -> str:
        """The dtype name to time in."""
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if torch.device(self.device).type == "cuda" else "float32"


def _decoder_config(s: ProfileSettings, longest: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=s.vocab, hidden_size=s.hidden, num_layers=s.layers,
                         num_heads=s.heads, num_kv_heads=s.kv_heads, ffn_hidden_size=s.ffn,
                         max_position=longest)


def _comm_world(s: ProfileSettings, device: torch.device) -> int:
    """Processes of the communication test: NCCL needs one GPU per rank."""
    if device.type == "cuda":
        return min(s.ranks, torch.cuda.device_count())
    return s.ranks


def _analytic_layout_rates(device: torch.device, attention_flops: float) -> dict:
    """Ring and hybrid rates as documented shares of the measured local rate (one GPU)."""
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    ring, hybrid = ((HOPPER_RING_SHARE, HOPPER_HYBRID_SHARE) if hopper
                    else (AMPERE_RING_SHARE, AMPERE_HYBRID_SHARE))
    return {"ring_attention_flops": attention_flops * ring,
            "hybrid_attention_flops": attention_flops * hybrid}


def _multi_rank(shape: Any, comm: dict, base: dict, world: int, sp_lengths: list[int]
                ) -> tuple[dict, dict]:
    """Profile fields from the communication test (links, ring/hybrid rates, communicator
    memory) and what was fitted, for ``measured``."""
    bandwidth, latency = fit.fit_comm(comm["all_to_all"])
    tasks = {kind: [t for t in comm["tasks"] if t["kind"] == kind]
             for kind in ("ring", "hybrid", "ulysses", "alone")}
    ulysses_bw = None
    if tasks["ulysses"] and tasks["alone"]:
        ulysses_bw = fit.ulysses_bandwidth(shape, sp_lengths, world,
                                           tasks["ulysses"][0]["seconds"],
                                           tasks["alone"][0]["seconds"], latency)
    if ulysses_bw is not None:
        # the runtime's Ulysses task costs more than a raw all-to-all shows: plan with that
        bandwidth = min(bandwidth, ulysses_bw)
    fields = {"intra_bandwidth": bandwidth, "intra_latency": latency,
              "inter_bandwidth": bandwidth, "inter_latency": latency,
              "communicator_bytes": comm.get("communicator_bytes", 0.0),
              "connection_bytes": comm.get("connection_bytes", 0.0)}
    hw = fit.placeholder(**{**base, **fields, "ranks_per_node": world})
    points = {}
    for kind, key in (("ring", "ring_attention_flops"), ("hybrid", "hybrid_attention_flops")):
        pts = [{"length": t["lengths"][0], "ulysses": t["ulysses"], "ring": t["ring"],
                "seconds": t["seconds"]} for t in tasks[kind]]
        if pts:
            fields[key] = fit.fit_layout_rate(shape, pts, hw, key, world)
            points[kind] = pts
    fields.setdefault("hybrid_attention_flops", fields.get("ring_attention_flops"))
    final = fit.placeholder(**{**base, **fields, "ranks_per_node": world})
    measured = {kind: fit.predictions(shape, pts, final, world) for kind, pts in points.items()}
    measured.update(all_to_all=comm["all_to_all"], ulysses_effective_bandwidth=ulysses_bw,
                    sequence_parallel={t["kind"]: t["seconds"] for t in tasks["ulysses"]
                                       + tasks["alone"]},
                    hybrid_rate="measured" if points.get("hybrid") else "ring's (needs 4 ranks)")
    return fields, measured


def _gemm_and_copy(s: ProfileSettings, cfg, device: torch.device, dtype: torch.dtype,
                   bar: Progress) -> tuple[list[dict], float, float]:
    """The GEMM timings, their best FLOP/s and the copy bandwidth."""
    bar.update(0, label="GEMM")
    gemm = [measure.measure_gemm(cfg, device, dtype, t, s.repeat) for t in (256, 1024)]
    linear_flops = max(g["flop_s"] for g in gemm)
    bar.note(f"GEMM: {linear_flops / 1e9:.2f} GFLOP/s")
    bar.update(label="copy")
    hbm_bandwidth = measure.measure_copy(device, 16 if s.quick else 256, s.repeat)
    bar.note(f"copy: {hbm_bandwidth / 1e9:.2f} GB/s")
    bar.update(label="copy")
    return gemm, linear_flops, hbm_bandwidth


def _task_points(s: ProfileSettings, cfg, lengths: list[int], device: torch.device,
                 dtype_name: str, bar: Progress) -> tuple[list[dict], list[dict]]:
    """Timed one-sequence tasks (each length, with no and with every layer recomputed) and
    timed packed tasks."""
    dtype = getattr(torch, dtype_name)
    recompute_layers = sorted({0, s.layers})
    # a tiny task pins the fixed per-task cost (Python and kernel-launch overhead of a micro-step),
    # which longer sequences alone leave to the fit to guess
    lengths = sorted(set(lengths) | {measure.TASK_ANCHOR_TOKENS})
    bar.update(0, label="model tasks")
    if s.concurrent and s.ranks > 1:
        points = measure.measure_model_concurrently(cfg, lengths, recompute_layers, s.ranks,
                                                    s.device, dtype_name, s.repeat, s.threads)
    else:
        points = measure.measure_model(cfg, lengths, recompute_layers, device, dtype, s.repeat,
                                       say=bar.note)
    bar.update(label="packed tasks")
    sizes = list(s.pack_sizes)
    if s.quick:
        sizes = [x for x in sizes if 512 <= x <= 8192] or sizes[:3]
    packs = measure.measure_packs(cfg, sizes, s.pack_seq, device, dtype, s.repeat, say=bar.note)
    bar.update(label="packed tasks")
    return points, packs


def _layout_rates(s: ProfileSettings, world: int, cfg, shape, base: dict,
                  layout_lengths: list[int], bar: Progress) -> tuple[dict, Optional[dict]]:
    """The link and layout fields of the profile, and the multi-rank measurements: measured over
    ``world`` processes, or (one rank) derived from the copy bandwidth and, on CUDA, the
    device's specification."""
    if world > 1:
        sp_lengths = [s.pack_seq] * (4 if s.quick else 8)
        job = dict(device=s.device, dtype=s.resolved_dtype(), threads=s.threads,
                   repeat=s.repeat, sizes=[4096, 65536, 1 << 20] if s.quick else
                   [4096, 32768, 262144, 1 << 20, 4 << 20, 16 << 20],
                   cfg=cfg, layout_lengths=layout_lengths, sp_lengths=sp_lengths)
        bar.update(0, label="communication")
        comm = measure.measure_comm(world, job)
        bar.update(label="communication")
        return _multi_rank(shape, comm, base, world, sp_lengths)
    hbm_bandwidth = base["hbm_bandwidth"]
    fields = {"intra_bandwidth": hbm_bandwidth / 4, "intra_latency": 2e-5,
              "inter_bandwidth": hbm_bandwidth / 4, "inter_latency": 2e-5}
    device = torch.device(s.device)
    if device.type == "cuda":
        fields.update(_analytic_layout_rates(device, base["attention_flops"]),
                      communicator_bytes=NCCL_COMMUNICATOR_BYTES,
                      connection_bytes=NCCL_CONNECTION_BYTES)
    return fields, None


def profile_hardware(s: ProfileSettings, progress: Optional[Progress] = None) -> dict:
    """Run every measurement and return the profile JSON object (checked: the planner loads
    it). ``progress``: a bar counting the `MEASUREMENTS` (its total is set here), the lines
    of each point printed through it; default: lines only."""
    device = torch.device(s.device)
    dtype_name = s.resolved_dtype()
    dtype = getattr(torch, dtype_name)
    if device.type == "cpu":
        torch.set_num_threads(s.threads)
    lengths = list(s.lengths[:3] if s.quick else s.lengths)
    layout_lengths = [n // 2 for n in s.layout_lengths] if s.quick else list(s.layout_lengths)
    cfg = _decoder_config(s, max(lengths + layout_lengths + [s.pack_seq]))
    shape = Decoder(cfg).shape()
    t0 = time.perf_counter()
    world = _comm_world(s, device)
    bar = progress if progress is not None else Progress("profiling", enabled=False)
    bar.total = len(MEASUREMENTS) - (world <= 1)
    gemm, linear_flops, hbm_bandwidth = _gemm_and_copy(s, cfg, device, dtype, bar)
    points, pack_points = _task_points(s, cfg, lengths, device, dtype_name, bar)
    # fit, derive the pack curve with the fitted attention/task terms; the pack curve is then
    # what is left of the packed tasks' times (one pass: refitting with the curve drifts, as task
    # overhead and the curve's small end trade off)
    coeffs, _ = fit.fit_profile(shape, points + pack_points, linear_flops, hbm_bandwidth)
    curve, pack_tokens = fit.pack_curve(shape, pack_points,
                                        fit.placeholder(linear_flops, hbm_bandwidth, **coeffs))
    base = dict(linear_flops=linear_flops, hbm_bandwidth=hbm_bandwidth, pack_curve=curve or None,
                comm_overlap=0.0 if device.type == "cpu" else 1.0, **coeffs)
    final = fit.placeholder(**base)
    report = fit.predictions(shape, points, final)  # what the planner will predict
    pack_points = fit.predictions(shape, pack_points, final)
    layout_fields, multi = _layout_rates(s, world, cfg, shape, base, layout_lengths, bar)
    ranks_per_node = max(1, world)
    data = {
        "format_version": 1,
        "name": s.name or f"{device.type}-{platform.node() or 'host'}-{s.threads}t",
        "peak_flops": linear_flops, "linear_flops": linear_flops,
        "attention_flops": coeffs["attention_flops"],
        "hbm_bytes": measure.memory_bytes(device, ranks_per_node),
        "hbm_bandwidth": hbm_bandwidth, "ranks_per_node": ranks_per_node,
        "token_overhead_s": coeffs["token_overhead_s"],
        "task_overhead_s": coeffs["task_overhead_s"],
        "pack_curve": curve or None, "pack_tokens": pack_tokens,
        # gloo moves ring blocks with the same cores that compute attention: nothing hides
        "comm_overlap": base["comm_overlap"],
        **layout_fields,
        "measured": {
            "device": str(device), "dtype": dtype_name, "threads": s.threads,
            "concurrent_processes": s.ranks if s.concurrent else 1,
            "torch": torch.__version__, "model": shape.to_dict(),
            "gemm": gemm, "model_points": report, "packs": pack_points,
            "multi_rank": multi,
            "fit_max_rel_error": max(abs(r["rel_error"]) for r in report + pack_points),
            "seconds": time.perf_counter() - t0,
        },
    }
    hardware_from_dict(data, where="the measured profile")  # the planner must accept it
    return data
