#!/usr/bin/env python
"""Measure the cost model's coefficients on this machine and write a hardware profile JSON.

    python tools/profile.py --out runs/cpu-profile.json            # this CPU, 1 thread per rank
    python tools/profile.py --device cuda --out gpu.json          # a GPU where one is lent
    python tools/simulate.py ... --hardware runs/cpu-profile.json # plans use measured costs

What is measured (the cost model's terms, see `megatron_dcp.plan.cost`):

* ``linear_flops``: FLOP/s of the reference decoder's GEMMs (its weight shapes, forward and
  backward), timed alone;
* ``attention_flops``, ``token_overhead_s``, ``task_overhead_s``: fitted (non-negative least
  squares on relative error) to the forward+backward time of the whole reference `Decoder` (run
  as one-sequence tasks, as the executor runs them; plus a 16-token task for the fixed per-task
  cost, and the packed tasks below) over a grid of lengths and checkpoint depths, with
  ``linear_flops`` fixed;
* ``hbm_bandwidth``: a large tensor copy; ``hbm_bytes``: memory per rank;
* ``intra_bandwidth`` / ``intra_latency``: all-to-all between ``--ranks`` processes on this
  machine (gloo on CPU, NCCL on CUDA), fitted as ``latency + bytes / bandwidth``;
* ``peak_flops``: the fastest GEMM seen (no data sheet for a CPU);
* ``comm_overlap``: 0 on CPU (gloo's transfers take the cores the attention runs on), else 1;
* ``pack_curve`` / ``pack_tokens``: forward+backward time per token of packed tasks (short
  sequences of ``--pack-seq`` tokens) at several task sizes: the GEMM and element-wise part per
  token relative to the best size, and the largest size within ``PACK_TOLERANCE`` of the best
  throughput (the planner's default pack budget). CPUs slow down when a task's activations leave
  the caches; on a GPU the curve is nearly flat and ``pack_tokens`` is left out.

Every raw measurement and the fit's per-point error are kept under ``"measured"``. One node:
the inter-node numbers are copies of the intra-node ones.
"""

from __future__ import annotations

import os
import sys

# This file is named like the standard library's `profile` (which cProfile, and so torch._dynamo,
# imports): drop tools/ from the import path so that `import profile` finds the real one.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from datetime import timedelta
from typing import Callable, Optional

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_dcp.models import Decoder, DecoderConfig  # noqa: E402
from megatron_dcp.plan.cost import CostModel  # noqa: E402
from megatron_dcp.plan.hardware import Hardware, hardware_from_dict  # noqa: E402


# ---------------------------------------------------------------------- timing helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, repeat: int, min_s: float = 0.05) -> float:
    """Median seconds of ``fn`` (one warm-up call; more repeats while calls are short, unless
    ``min_s`` is 0: collectives need the same number of calls on every rank)."""
    fn()
    _sync(device)
    times = []
    while len(times) < repeat or (sum(times) < min_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active-set elimination (few unknowns, no scipy needed)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return x


# ---------------------------------------------------------------------- measurements
def measure_gemm(cfg: DecoderConfig, device: torch.device, dtype: torch.dtype,
                 tokens: int, repeat: int) -> dict:
    """FLOP/s of the decoder's layer GEMMs (forward + both backward GEMMs) at ``tokens`` rows."""
    e, f, kv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_kv_heads * cfg.head_dim
    shapes = [(e, e), (e, kv), (e, kv), (e, e), (e, f), (e, f), (f, e)]
    weights = [torch.randn(i, o, device=device, dtype=dtype) for i, o in shapes]
    inputs = {i: torch.randn(tokens, i, device=device, dtype=dtype) for i, _ in shapes}
    grads = {o: torch.randn(tokens, o, device=device, dtype=dtype) for _, o in shapes}

    def run() -> None:
        for w, (i, o) in zip(weights, shapes):
            inputs[i] @ w                      # forward
            grads[o] @ w.t()                   # input gradient
            inputs[i].t() @ grads[o]           # weight gradient

    seconds = timed(run, device, repeat)
    flops = sum(3 * 2 * tokens * i * o for i, o in shapes)
    return {"tokens": tokens, "seconds": seconds, "flops": flops, "flop_s": flops / seconds}


def measure_copy(device: torch.device, mbytes: int, repeat: int) -> float:
    """Bytes/s of a large copy (read + write)."""
    n = mbytes * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeat)
    return 2 * src.numel() * 4 / seconds


def measure_model(cfg: DecoderConfig, lengths: list[int], depths: list[int],
                  device: torch.device, dtype: torch.dtype, repeat: int,
                  verbose: bool = True) -> list[dict]:
    """Forward+backward seconds of the whole decoder on one sequence per (length, depth)."""
    model = Decoder(cfg, seed=0).to(device=device, dtype=dtype)
    points = []
    for n in lengths:
        for depth in depths:
            step = _task_step(model, cfg, [n], device, ckpt=depth)  # a one-sequence task
            points.append({"length": n, "ckpt": depth,
                           "seconds": timed(step, device, repeat)})
            if verbose:
                print(f"  model fwd+bwd  length {n:6d}  ckpt {depth}: "
                      f"{points[-1]['seconds']:.4f} s", flush=True)
    return points


TASK_ANCHOR_TOKENS = 16
"""Length of the tiny one-sequence task timed with the model points (fixed per-task cost)."""
PACK_TOLERANCE = 0.10
"""``pack_tokens`` is the largest measured task size whose time per token is within this fraction
of the best (bigger tasks pay the per-micro-step costs of the engines less often)."""


def _task_step(model: Decoder, cfg: DecoderConfig, lengths: list[int], device: torch.device,
               ulysses: int = 1, ring: int = 1, rank: int = 0, group=None,
               ckpt: int = 0) -> Callable[[], None]:
    """Forward+backward of one task over packed sequences ``lengths``, as the executor runs it
    (group rank ``rank`` of ``ulysses x ring`` ranks in process group ``group``, ``ckpt``
    recomputed layers)."""
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime.context import TaskContext, task_context
    from megatron_dcp.runtime.layout import ShardLayout

    degree = ulysses * ring
    layout = ShardLayout.build(lengths, ulysses, ring, rank)
    task = Task(id=0, ranks=tuple(range(degree)), seqs=tuple(range(len(lengths))),
                ulysses=ulysses, ring=ring, ckpt_layers=ckpt)
    ctx = TaskContext(task=task, group_rank=rank, group=group if degree > 1 else None,
                      layout=layout, ckpt_layers=ckpt)
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, cfg.vocab_size, (sum(lengths) + 1,), generator=gen)
    ids = layout.shard(packed[:-1], 0).to(device)
    labels = layout.shard(packed[1:], -100).to(device)
    positions = layout.position_ids.to(device)

    def step() -> None:
        with task_context(ctx):
            model.loss(ids, positions, labels).backward()
        model.zero_grad(set_to_none=True)

    return step


def measure_packs(cfg: DecoderConfig, sizes: list[int], seq_len: int, device: torch.device,
                  dtype: torch.dtype, repeat: int, verbose: bool = True) -> list[dict]:
    """Forward+backward seconds of one degree-1 task per size: ``size // seq_len`` sequences of
    ``seq_len`` tokens packed (varlen attention within each sequence, as the executor runs it)."""
    model = Decoder(cfg, seed=0).to(device=device, dtype=dtype)
    points = []
    for size in sizes:
        lengths = [min(seq_len, size)] * max(1, size // seq_len)
        tokens = sum(lengths)
        seconds = timed(_task_step(model, cfg, lengths, device), device, repeat)
        points.append({"tokens": tokens, "seq_len": lengths[0], "seconds": seconds})
        if verbose:
            print(f"  packed task {tokens:6d} tokens ({len(lengths)} x {lengths[0]}): "
                  f"{seconds / tokens * 1e6:.2f} us/token", flush=True)
    return points


def pack_curve(cfg: DecoderConfig, points: list[dict], hw: Hardware
               ) -> tuple[list[list[float]], Optional[int]]:
    """(``pack_curve``, ``pack_tokens``) from `measure_packs` points and fitted coefficients.

    The factor of a size is its measured time without the cost model's attention and per-task
    terms over the cost model's GEMM and element-wise terms (the cost model multiplies those by
    it, so it reproduces the packed tasks' times). Timings on a shared machine are noisy, and the
    effect (activations leaving the caches) grows steadily with the size, so the factors and the
    per-token times are smoothed by a straight line in the task size before use.
    ``pack_tokens``: the largest measured size whose smoothed per-token time is within
    ``PACK_TOLERANCE`` of the smallest; ``None`` when that is the largest size (no budget needed).
    """
    if not points:
        return [], None
    cm = CostModel(Decoder(cfg).shape(), hw, world_size=1, memory_budget=1e15)
    n = cm.model.num_layers
    sizes = np.array([float(p["tokens"]) for p in points])
    factors, per_token = [], []
    for p in points:
        tokens = p["tokens"]
        pairs = tokens // p["seq_len"] * cm.attn_pairs(p["seq_len"])
        rest = p["seconds"] - pairs * n * cm._attn_layer * 3.5 - cm.task_overhead
        work = tokens * (n * cm._lin_layer * 3.0 + cm._lin_head + n * cm._token_layer)
        factors.append(max(rest, 0.05 * p["seconds"]) / work)
        per_token.append(p["seconds"] / tokens)
    smooth_factor = _line(sizes, np.array(factors))
    smooth_time = _line(sizes, np.array(per_token))
    curve = [[float(t), round(float(max(f, 0.05)), 4)] for t, f in zip(sizes, smooth_factor)]
    ok = sizes[smooth_time <= (1 + PACK_TOLERANCE) * smooth_time.min()]
    budget = int(ok.max())
    return curve, (None if budget == int(sizes.max()) else budget)


def _line(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares straight line through (x, y) (relative error), evaluated at ``x``."""
    if len(x) < 2:
        return y
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    return coef[0] + coef[1] * x


def _model_worker(rank: int, cfg: DecoderConfig, lengths: list[int], depths: list[int],
                  device_name: str, dtype_name: str, repeat: int, threads: int,
                  out_dir: str) -> None:
    """One of several processes timing the model at the same time (see ``--concurrent``)."""
    torch.set_num_threads(threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
    points = measure_model(cfg, lengths, depths, device, getattr(torch, dtype_name), repeat,
                           verbose=rank == 0)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump(points, handle)


def measure_model_concurrently(cfg: DecoderConfig, lengths: list[int], depths: list[int],
                               args: argparse.Namespace) -> list[dict]:
    """Model timings with ``--ranks`` processes timing at once (as ranks of a job share the
    machine's cores, caches and memory bandwidth); the slowest process's time per point."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_model_worker, args=(cfg, lengths, depths, args.device, args.dtype, args.repeat,
                                      args.threads, tmp), nprocs=args.ranks)
        runs = []
        for r in range(args.ranks):
            with open(os.path.join(tmp, f"{r}.json")) as handle:
                runs.append(json.load(handle))
    return [{**points[0], "seconds": max(p["seconds"] for p in points),
             "per_process": [p["seconds"] for p in points]} for points in zip(*runs)]


def _sp_times(cfg: DecoderConfig, lengths: list[int], rank: int, world: int,
              device: torch.device, dtype: torch.dtype, repeat: int) -> dict:
    """Seconds of one task over ``lengths`` on all ``world`` ranks (Ulysses where the heads
    divide, ring), and of each rank running its half of the sequences alone at the same time
    (the same compute without communication)."""
    import torch.distributed as dist

    model = Decoder(cfg, seed=0).to(device=device, dtype=dtype)
    layouts = {"ring": (1, world)}
    if cfg.num_heads % world == 0 and cfg.num_kv_heads % world == 0:
        layouts["ulysses"] = (world, 1)
    out = {}
    for name, (u, r) in layouts.items():
        dist.barrier()
        out[name] = timed(_task_step(model, cfg, lengths, device, u, r, rank, dist.group.WORLD),
                          device, repeat, 0.0)
    share = lengths[rank::world]
    dist.barrier()
    out["alone"] = timed(_task_step(model, cfg, share, device), device, repeat, 0.0)
    return out


def _comm_worker(rank: int, world: int, port: int, sizes: list[int], repeat: int,
                 backend: str, out_path: str, sp: Optional[tuple] = None) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        results = []
        for nbytes in sizes:
            x = torch.zeros(max(world, nbytes // 4 // world * world), device=device)
            y = torch.empty_like(x)
            dist.barrier()
            seconds = timed(lambda: dist.all_to_all_single(y, x), device, max(repeat, 5), 0.0)
            # Bytes each rank sends to the others (the cost model's (u-1)/u of its volume).
            results.append({"bytes": x.numel() * 4 * (world - 1) / world, "seconds": seconds})
        sp_times = _sp_times(sp[0], sp[1], rank, world, device, getattr(torch, sp[2]),
                             repeat) if sp else {}
        times = torch.tensor([r["seconds"] for r in results] + list(sp_times.values()),
                             dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if rank == 0:
            for r, t in zip(results, times.tolist()):
                r["seconds"] = t
            sp_out = dict(zip(sp_times, times.tolist()[len(results):]))
            with open(out_path, "w") as handle:
                json.dump({"all_to_all": results, "sp": sp_out}, handle)
    finally:
        dist.destroy_process_group()


def measure_comm(ranks: int, device: torch.device, repeat: int, quick: bool,
                 sp: Optional[tuple] = None) -> dict:
    """All-to-all time over ``ranks`` local processes for a range of message sizes; with ``sp``
    (config, sequence lengths, dtype name) also `_sp_times`."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    sizes = [4096, 65536, 1 << 20] if quick else [4096, 32768, 262144, 1 << 20, 4 << 20, 16 << 20]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "comm.json")
        mp.spawn(_comm_worker, args=(ranks, port, sizes, repeat, backend, path, sp),
                 nprocs=ranks)
        with open(path) as handle:
            return json.load(handle)


# ---------------------------------------------------------------------- fitting
def fit_profile(cfg: DecoderConfig, points: list[dict], linear_flops: float,
                hbm_bandwidth: float) -> tuple[dict, list[dict]]:
    """attention_flops, token_overhead_s, task_overhead_s from the model timings (see module doc):
    one-sequence points (``length``, ``ckpt``) and packed tasks (``tokens`` of ``seq_len``).

    Uses the cost model's own formulas: the features are what `CostModel.time_of` multiplies
    each coefficient by at degree 1, so the fitted numbers reproduce its predictions.
    """
    shape = Decoder(cfg).shape()
    n, h = shape.num_layers, shape.hidden_size
    probe = CostModel(shape, _placeholder(linear_flops, hbm_bandwidth), world_size=1,
                      memory_budget=1e15)
    rows, target = [], []
    for p in points:
        length, c = p.get("length", p.get("tokens")), p.get("ckpt", 0)
        passes = 3.0 + c / n
        linear = length * (n * probe._lin_layer * passes + probe._lin_head)
        pairs = probe.attn_pairs(length) if "length" in p else \
            p["tokens"] // p["seq_len"] * probe.attn_pairs(p["seq_len"])
        rows.append([pairs * n * 4 * h * (3.5 + c / n),   # x 1 / attention_flops
                     length * n * passes / 3.0,            # x token_overhead_s
                     1.0])                                 # x task_overhead_s
        target.append(p["seconds"] - linear)
    a, b = np.array(rows), np.array(target)
    weight = 1.0 / np.array([p["seconds"] for p in points])   # fit relative error
    x = nnls(a * weight[:, None], b * weight)
    inv_attn, token_s, task_s = (float(v) for v in x)
    attention_flops = 1.0 / inv_attn if inv_attn > 0 else linear_flops
    coeffs = {"attention_flops": attention_flops, "token_overhead_s": token_s,
              "task_overhead_s": task_s}
    return coeffs, predictions(cfg, points, _placeholder(linear_flops, hbm_bandwidth, **coeffs))


def predictions(cfg: DecoderConfig, points: list[dict], hw: Hardware) -> list[dict]:
    """Each timing point (a sequence: ``length``, ``ckpt``; or a packed task: ``tokens`` of
    ``seq_len`` sequences) with the cost model's ``predicted`` seconds and ``rel_error``."""
    cm = CostModel(Decoder(cfg).shape(), hw, world_size=1, memory_budget=1e15)
    lay = cm.layouts(1)[0]
    out = []
    for p in points:
        if "length" in p:
            pred = cm.time_of(p["length"], cm.attn_pairs(p["length"]), lay, p["ckpt"])
        else:
            pairs = p["tokens"] // p["seq_len"] * cm.attn_pairs(p["seq_len"])
            pred = cm.time_of(p["tokens"], pairs, lay, 0)
        out.append({**p, "predicted": pred, "rel_error": pred / p["seconds"] - 1.0})
    return out


def _placeholder(linear_flops: float, hbm_bandwidth: float, **extra) -> Hardware:
    """A Hardware with the measured compute numbers and neutral links (for fitting only)."""
    values = dict(name="fit", peak_flops=linear_flops, linear_flops=linear_flops,
                  attention_flops=extra.pop("attention_flops", linear_flops), hbm_bytes=1e12,
                  hbm_bandwidth=hbm_bandwidth, intra_bandwidth=1e9, intra_latency=1e-5,
                  inter_bandwidth=1e9, inter_latency=1e-5, ranks_per_node=1,
                  token_overhead_s=extra.pop("token_overhead_s", 0.0),
                  task_overhead_s=extra.pop("task_overhead_s", 0.0),
                  pack_curve=extra.pop("pack_curve", None))
    return Hardware(**values)


def fit_comm(points: list[dict]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of ``seconds = latency + bytes / bandwidth``."""
    a = np.array([[1.0, p["bytes"]] for p in points])
    b = np.array([p["seconds"] for p in points])
    weight = 1.0 / b
    lat, inv_bw = nnls(a * weight[:, None], b * weight)
    bw = 1.0 / inv_bw if inv_bw > 0 else max(p["bytes"] / p["seconds"] for p in points)
    return float(bw), float(max(lat, 1e-7))


def sp_bandwidth(cfg: DecoderConfig, lengths: list[int], world: int, times: dict,
                 latency: float) -> dict:
    """Bandwidth (bytes/s, the cost model's bytes) at which the cost model's communication terms
    of a ``world``-rank task equal what the runtime measured: its time minus the same ranks'
    compute alone (`_sp_times`). Per layout; a layout without measurable extra time is left out.
    """
    cm = CostModel(Decoder(cfg).shape(), _placeholder(1e12, 1e12), world_size=world,
                   memory_budget=1e15)
    n = cm.model.num_layers
    local = sum(lengths) / world
    volume = {"ulysses": 2 * n * local * cm._a2a_bytes * (world - 1) / world,
              "ring": (world - 1) * n * 3 * local * cm._ring_bytes}
    fixed = {"ulysses": 2 * n * 4 * latency, "ring": (world - 1) * n * 3 * latency}
    out = {}
    for name in ("ulysses", "ring"):
        if name not in times:
            continue
        extra = times[name] - times["alone"] - fixed[name]
        if extra > 0:
            out[name] = volume[name] / extra
    return out


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# ---------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    """Command-line flags (model size of the timing runs, grid, output)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/profile.json", help="profile JSON to write")
    p.add_argument("--name", default=None, help="hardware name in the profile")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--ranks", type=int, default=2, help="processes of the communication test "
                   "(and ranks per node in the profile); 0 skips it")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=None,
                   help="MLP width; default: the reference Decoder's for --hidden (688 at 256)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lengths", default="128,256,512,1024,2048",
                   help="comma-separated sequence lengths of the model timings")
    p.add_argument("--pack-sizes", default="256,512,1024,2048,4096,8192,16384",
                   help="comma-separated packed-task sizes (tokens) of the pack curve; '' skips it")
    p.add_argument("--pack-seq", type=int, default=256,
                   help="length of the short sequences packed into those tasks")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--concurrent", action="store_true",
                   help="time the model in --ranks processes at once (what a job's ranks see "
                        "when they share a machine); default: one process alone")
    p.add_argument("--quick", action="store_true", help="tiny grid (tests)")
    return p


def profile(args: argparse.Namespace) -> dict:
    """Run every measurement and return the profile JSON object."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.quick:
        lengths = lengths[:3]
    cfg = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                        num_heads=args.heads, num_kv_heads=args.kv_heads,
                        ffn_hidden_size=args.ffn, max_position=max(lengths + [args.pack_seq]))
    t0 = time.perf_counter()
    gemm = [measure_gemm(cfg, device, dtype, t, args.repeat) for t in (256, 1024)]
    linear_flops = max(g["flop_s"] for g in gemm)
    print(f"GEMM: {linear_flops / 1e9:.2f} GFLOP/s", flush=True)
    hbm_bandwidth = measure_copy(device, 16 if args.quick else 256, args.repeat)
    print(f"copy: {hbm_bandwidth / 1e9:.2f} GB/s", flush=True)
    depths = sorted({0, args.layers})
    # a tiny task pins the fixed per-task cost (Python and kernel-launch overhead of a micro-step),
    # which longer sequences alone leave to the fit to guess
    lengths = sorted(set(lengths) | {TASK_ANCHOR_TOKENS})
    if args.concurrent and args.ranks > 1:
        points = measure_model_concurrently(cfg, lengths, depths, args)
    else:
        points = measure_model(cfg, lengths, depths, device, dtype, args.repeat)
    sizes = [int(x) for x in args.pack_sizes.split(",") if x.strip()]
    if args.quick:
        sizes = [x for x in sizes if 512 <= x <= 8192] or sizes[:3]
    pack_points = measure_packs(cfg, sizes, args.pack_seq, device, dtype, args.repeat)
    # fit, derive the pack curve with the fitted attention/task terms, refit with the curve
    # coefficients from single sequences and packed tasks together; the pack curve is then what
    # is left of the packed tasks' times (one pass: refitting with the curve drifts, as task
    # overhead and the curve's small end trade off)
    coeffs, _ = fit_profile(cfg, points + pack_points, linear_flops, hbm_bandwidth)
    curve, pack_tokens = pack_curve(cfg, pack_points,
                                    _placeholder(linear_flops, hbm_bandwidth, **coeffs))
    final = _placeholder(linear_flops, hbm_bandwidth, pack_curve=curve or None, **coeffs)
    report = predictions(cfg, points, final)  # what the planner will predict
    pack_points = predictions(cfg, pack_points, final)
    sp_lengths = [args.pack_seq] * (4 if args.quick else 8)
    measured_comm = measure_comm(args.ranks, device, args.repeat, args.quick,
                                 (cfg, sp_lengths, args.dtype)) if args.ranks > 1 else {}
    comm = measured_comm.get("all_to_all", [])
    sp_bw: dict = {}
    if comm:
        bandwidth, latency = fit_comm(comm)
        sp_bw = sp_bandwidth(cfg, sp_lengths, args.ranks, measured_comm["sp"], latency)
        if sp_bw:
            # one bandwidth serves both layouts: the lower keeps the planner from splitting
            # sequences where the runtime's communication costs more than raw all-to-all shows
            bandwidth = min(bandwidth, min(sp_bw.values()))
    else:
        bandwidth, latency = hbm_bandwidth / 4, 2e-5
    ranks_per_node = max(1, args.ranks)
    name = args.name or f"{device.type}-{platform.node() or 'host'}-{args.threads}t"
    data = {
        "format_version": 1, "name": name, "peak_flops": linear_flops,
        "linear_flops": linear_flops, "attention_flops": coeffs["attention_flops"],
        "hbm_bytes": _memory_bytes(device) / (ranks_per_node if device.type == "cpu" else 1),
        "hbm_bandwidth": hbm_bandwidth,
        "intra_bandwidth": bandwidth, "intra_latency": latency,
        "inter_bandwidth": bandwidth, "inter_latency": latency,
        "ranks_per_node": ranks_per_node,
        "token_overhead_s": coeffs["token_overhead_s"],
        "task_overhead_s": coeffs["task_overhead_s"],
        "pack_curve": curve or None, "pack_tokens": pack_tokens,
        # gloo moves ring blocks with the same cores that compute attention: nothing hides
        "comm_overlap": 0.0 if device.type == "cpu" else 1.0,
        "measured": {
            "device": str(device), "dtype": args.dtype, "threads": args.threads,
            "concurrent_processes": args.ranks if args.concurrent else 1,
            "torch": torch.__version__, "model": Decoder(cfg).shape().to_dict(),
            "gemm": gemm, "model_points": report, "all_to_all": comm, "packs": pack_points,
            "sequence_parallel": {"lengths": sp_lengths, "seconds": measured_comm.get("sp"),
                                  "effective_bandwidth": sp_bw} if comm else None,
            "fit_max_rel_error": max(abs(r["rel_error"]) for r in report + pack_points
                                     if "rel_error" in r),
            "seconds": time.perf_counter() - t0,
        },
    }
    hardware_from_dict(data)  # the planner must accept it
    return data


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: measure, fit, write the JSON, print a summary."""
    args = build_parser().parse_args(argv)
    data = profile(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(data, handle, indent=1)
    m = data["measured"]
    print(f"wrote {args.out}: linear {data['linear_flops'] / 1e9:.2f} GFLOP/s, attention "
          f"{data['attention_flops'] / 1e9:.2f} GFLOP/s, token overhead "
          f"{data['token_overhead_s'] * 1e6:.2f} us, task overhead "
          f"{data['task_overhead_s'] * 1e3:.2f} ms, all-to-all {data['intra_bandwidth'] / 1e9:.2f}"
          f" GB/s + {data['intra_latency'] * 1e6:.0f} us; fit max error "
          f"{m['fit_max_rel_error'] * 100:.1f} % ({m['seconds']:.0f} s); pack budget "
          f"{str(data['pack_tokens']) + ' tokens' if data['pack_tokens'] else 'none'}, pack "
          f"curve {data['pack_curve']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
