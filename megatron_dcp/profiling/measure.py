"""Timed measurements on this machine: GEMMs, memory copies, the reference decoder's tasks (one
rank; several processes at once; Ulysses, ring and hybrid tasks over ``ranks`` processes) and
all-to-all collectives. The tasks run the way the executor runs them (the same shard layout,
task argument and process groups), so what is timed is what a plan will cost.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

from megatron_dcp.config import IGNORE_INDEX
from megatron_dcp.models import Decoder, DecoderConfig
from megatron_dcp.plan.plan import Task
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.layout import ShardLayout
from megatron_dcp.runtime.ports import free_port

TASK_ANCHOR_TOKENS = 16
"""Length of the tiny one-sequence task timed with the model points (fixed per-task cost)."""


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


def task_step(model: Decoder, cfg: DecoderConfig, lengths: list[int], device: torch.device, *,
              ulysses: int = 1, ring: int = 1, rank: int = 0, pool: Any = None,
              recompute_layers: int = 0) -> Callable[[], None]:
    """Forward+backward of one task over packed sequences ``lengths``, as the executor runs it:
    group rank ``rank`` of ``ulysses x ring`` ranks (their process groups from ``pool``, a
    `megatron_dcp.runtime.groups.GroupPool`: creating them is collective), ``recompute_layers``
    recomputed layers."""
    degree = ulysses * ring
    task = Task(id=0, ranks=tuple(range(degree)), seqs=tuple(range(len(lengths))),
                ulysses=ulysses, ring=ring, recompute_layers=recompute_layers)
    layout = ShardLayout.build(lengths, ulysses, ring, rank)
    if degree == 1:
        ctx = TaskContext(task=task, group_rank=0, layout=layout,
                          recompute_layers=recompute_layers)
    else:
        from megatron_dcp.runtime.groups import groups_of_task

        pool.ensure_groups(groups_of_task(task))
        ctx = pool.context_for(task, rank, layout)
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, cfg.vocab_size, (sum(lengths) + 1,), generator=gen)
    ids = layout.shard(packed[:-1], 0).to(device)
    labels = layout.shard(packed[1:], IGNORE_INDEX).to(device)
    positions = layout.position_ids.to(device)

    def step() -> None:
        # the task as an argument, as the executor passes it (a recompute on CUDA's autograd
        # thread keeps it)
        model.loss(ids, positions, labels, task=ctx).backward()
        model.zero_grad(set_to_none=True)

    return step


def measure_model(cfg: DecoderConfig, lengths: list[int], recompute_layers: list[int],
                  device: torch.device, dtype: torch.dtype, repeat: int,
                  verbose: bool = True, say: Callable[[str], None] = print) -> list[dict]:
    """Forward+backward seconds of the whole decoder on one sequence per length and per number
    of recomputed layers; ``verbose``: ``say`` a line per point."""
    model = Decoder(cfg, seed=0).to(device=device, dtype=dtype)
    points = []
    for n in lengths:
        for layers in recompute_layers:
            step = task_step(model, cfg, [n], device, recompute_layers=layers)  # one sequence
            points.append({"length": n, "recompute_layers": layers,
                           "seconds": timed(step, device, repeat)})
            if verbose:
                say(f"  model fwd+bwd  length {n:6d}  recompute_layers {layers}: "
                    f"{points[-1]['seconds']:.4f} s")
    return points


def measure_packs(cfg: DecoderConfig, sizes: list[int], seq_len: int, device: torch.device,
                  dtype: torch.dtype, repeat: int, verbose: bool = True,
                  say: Callable[[str], None] = print) -> list[dict]:
    """Forward+backward seconds of one degree-1 task per size: ``size // seq_len`` sequences of
    ``seq_len`` tokens packed (varlen attention within each sequence, as the executor runs it);
    ``verbose``: ``say`` a line per size."""
    model = Decoder(cfg, seed=0).to(device=device, dtype=dtype)
    points = []
    for size in sizes:
        lengths = [min(seq_len, size)] * max(1, size // seq_len)
        tokens = sum(lengths)
        seconds = timed(task_step(model, cfg, lengths, device), device, repeat)
        points.append({"tokens": tokens, "seq_len": lengths[0], "seconds": seconds})
        if verbose:
            say(f"  packed task {tokens:6d} tokens ({len(lengths)} x {lengths[0]}): "
                f"{seconds / tokens * 1e6:.2f} us/token")
    return points


def _device_of_rank(device_name: str, rank: int) -> torch.device:
    """This process's device: one GPU per rank on CUDA."""
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def _model_worker(rank: int, cfg: DecoderConfig, lengths: list[int], depths: list[int],
                  device_name: str, dtype_name: str, repeat: int, threads: int,
                  out_dir: str) -> None:
    """One of several processes timing the model at the same time."""
    torch.set_num_threads(threads)
    device = _device_of_rank(device_name, rank)
    points = measure_model(cfg, lengths, depths, device, getattr(torch, dtype_name), repeat,
                           verbose=rank == 0)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump(points, handle)


def measure_model_concurrently(cfg: DecoderConfig, lengths: list[int], depths: list[int],
                               processes: int, device_name: str, dtype_name: str, repeat: int,
                               threads: int) -> list[dict]:
    """Model timings with ``processes`` processes timing at once (as ranks of a job share the
    machine's cores, caches and memory bandwidth); the slowest process's time per point."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_model_worker, args=(cfg, lengths, depths, device_name, dtype_name, repeat,
                                      threads, tmp), nprocs=processes)
        runs = []
        for r in range(processes):
            with open(os.path.join(tmp, f"{r}.json")) as handle:
                runs.append(json.load(handle))
    return [{**points[0], "seconds": max(p["seconds"] for p in points),
             "per_process": [p["seconds"] for p in points]} for points in zip(*runs)]


def _layout_tasks(cfg: DecoderConfig, world: int, job: dict) -> list[dict]:
    """The multi-rank tasks timed on ``world`` ranks: one sequence per ``layout_lengths`` entry
    as a ring (all ranks) and, from 4 ranks on, as a hybrid (Ulysses 2 x ring); and the packed
    ``sp_lengths`` as one Ulysses task (where the heads divide) beside each rank running its
    share of them alone (the same compute without communication)."""
    tasks = [{"kind": "ring", "lengths": [n], "ulysses": 1, "ring": world}
             for n in job["layout_lengths"]]
    if world >= 4 and world % 2 == 0 and cfg.num_heads % 2 == 0 and cfg.num_kv_heads % 2 == 0:
        tasks += [{"kind": "hybrid", "lengths": [n], "ulysses": 2, "ring": world // 2}
                  for n in job["layout_lengths"]]
    if cfg.num_heads % world == 0 and cfg.num_kv_heads % world == 0:
        tasks.append({"kind": "ulysses", "lengths": job["sp_lengths"], "ulysses": world,
                      "ring": 1})
        tasks.append({"kind": "alone", "lengths": job["sp_lengths"], "ulysses": 1, "ring": 1})
    return tasks


def _communicator_bytes(world: int, device: torch.device) -> tuple[float, float]:
    """The device memory NCCL's lazily set-up buffers take, as the planner charges them
    (`megatron_dcp.plan.vocabulary.Vocabulary.charge`): ``(communicator_bytes,
    connection_bytes)``: one more communicator over every rank that has run an all-reduce, and
    one send/receive connection (an all-to-all over a fresh communicator connects every other
    rank both ways: its memory over ``2 (world - 1)``). The free memory the driver reports
    before and after two of each."""
    import torch.distributed as dist

    from megatron_dcp.plan.vocabulary import ALL_REDUCE, ALL_TO_ALL
    from megatron_dcp.runtime.groups import warm_group

    taken = []
    for kind in (ALL_REDUCE, ALL_TO_ALL):
        torch.cuda.synchronize(device)
        before = torch.cuda.mem_get_info(device)[0]
        for _ in range(2):
            warm_group(dist.new_group(list(range(world))), list(range(world)), {kind})
        torch.cuda.synchronize(device)
        taken.append(max(0.0, (before - torch.cuda.mem_get_info(device)[0]) / 2))
    return taken[0], taken[1] / max(1, 2 * (world - 1))


def _comm_worker(rank: int, world: int, port: int, job: dict, out_path: str) -> None:
    """One rank of the communication test (see `measure_comm`)."""
    import torch.distributed as dist

    from megatron_dcp.runtime.groups import (DEFAULT_GROUP_TIMEOUT, GroupPool,
                                             before_init_process_group, destroy_process_groups)

    torch.set_num_threads(job["threads"])
    device = _device_of_rank(job["device"], rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    before_init_process_group()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=DEFAULT_GROUP_TIMEOUT)
    try:
        results = []
        for nbytes in job["sizes"]:
            x = torch.zeros(max(world, nbytes // 4 // world * world), device=device)
            y = torch.empty_like(x)
            dist.barrier()
            seconds = timed(lambda: dist.all_to_all_single(y, x), device, max(job["repeat"], 5),
                            0.0)
            # Bytes each rank sends to the others (the cost model's (u-1)/u of its volume).
            results.append({"bytes": x.numel() * 4 * (world - 1) / world, "seconds": seconds})
        cfg, dtype = job["cfg"], getattr(torch, job["dtype"])
        model = Decoder(cfg, seed=0).to(device=device, dtype=dtype)
        pool = GroupPool()
        tasks = _layout_tasks(cfg, world, job)
        for task in tasks:
            alone = task["kind"] == "alone"
            lengths = task["lengths"][rank::world] if alone else task["lengths"]
            step = task_step(model, cfg, lengths, device, ulysses=task["ulysses"],
                             ring=task["ring"], rank=0 if alone else rank, pool=pool)
            dist.barrier()
            task["seconds"] = timed(step, device, job["repeat"], 0.0)
        comm_bytes = _communicator_bytes(world, device) if backend == "nccl" else (0.0, 0.0)
        times = torch.tensor([r["seconds"] for r in results] + [t["seconds"] for t in tasks]
                             + list(comm_bytes), dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank decides
        if rank == 0:
            values = times.tolist()
            for r, t in zip(results + tasks, values):
                r["seconds"] = t
            with open(out_path, "w") as handle:
                json.dump({"all_to_all": results, "tasks": tasks,
                           "communicator_bytes": values[-2], "connection_bytes": values[-1]},
                          handle)
    finally:
        destroy_process_groups()


def measure_comm(world: int, job: dict) -> dict:
    """All-to-all times over ``world`` local processes for ``job["sizes"]`` bytes, the times of
    `_layout_tasks`, and (NCCL) the memory of a communicator's all-reduce and of a send/receive
    connection. ``job``: device, dtype (names), threads, repeat, sizes, cfg (`DecoderConfig`),
    layout_lengths, sp_lengths."""
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "comm.json")
        mp.spawn(_comm_worker, args=(world, port, job, path), nprocs=world)
        with open(path) as handle:
            return json.load(handle)


def memory_bytes(device: torch.device, processes: int) -> float:
    """Device memory of one rank: the GPU's, or the host's shared by ``processes`` ranks."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(processes, 1)

