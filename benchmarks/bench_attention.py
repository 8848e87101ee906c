"""Side-by-side timing of dcp_attention layouts (forward + backward) on gloo/CPU ranks.

    OMP_NUM_THREADS=1 python benchmarks/bench_attention.py --world 2 --lengths 1024 2048 4096

For each length, one sequence runs at degree 1 (on rank 0; the other ranks wait), then with
every layout of ``--world`` ranks (Ulysses, ring, hybrid where the world allows). Reported:
median over ``--repeats`` of the slowest rank's forward+backward time of that one sequence, and
the speed-up over degree 1 (ideal: the number of ranks, while ranks <= cores). Writes a
Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dcp.plan.plan import Task
from megatron_dcp.runtime.attention import dcp_attention
from megatron_dcp.runtime.context import TaskContext, task_context
from megatron_dcp.runtime.kernels import forced_backend
from megatron_dcp.runtime.layout import ShardLayout


def layouts(world: int) -> list[tuple[str, int, int]]:
    """(name, ulysses, ring) of every layout of ``world`` ranks, degree 1 first."""
    out = [("degree 1", 1, 1)]
    for u in range(world, 0, -1):
        if world % u == 0:
            r = world // u
            name = "ulysses" if r == 1 else "ring" if u == 1 else f"hybrid {u}x{r}"
            out.append((f"{name} {world}" if "hybrid" not in name else name, u, r))
    return out


def _time_one(rank, world, n, u, r, args, groups) -> float:
    if u * r == 1:
        task = Task(id=0, ranks=(rank,), seqs=(0,))
        ctx = TaskContext(task=task, group_rank=0, layout=ShardLayout.build([n], 1, 1, 0))
    else:
        task = Task(id=0, ranks=tuple(range(world)), seqs=(0,), ulysses=u, ring=r)
        ctx = TaskContext(task=task, group_rank=rank, group=groups[tuple(range(world))],
                          ulysses_group=groups.get(task.ulysses_group(rank)),
                          ring_group=groups.get(task.ring_group(rank)),
                          layout=ShardLayout.build([n], u, r, rank))
    t = ctx.layout.num_tokens
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(t, args.heads, args.head_dim, generator=gen, requires_grad=True)
    k = torch.randn(t, args.kv_heads, args.head_dim, generator=gen, requires_grad=True)
    v = torch.randn(t, args.kv_heads, args.head_dim, generator=gen, requires_grad=True)
    times = []
    for _ in range(args.repeats + 1):  # the first run warms up
        dist.barrier()
        start = time.perf_counter()
        if u * r > 1 or rank == 0:
            with task_context(ctx):
                dcp_attention(q, k, v, causal=not args.non_causal).sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times[1:])


def _body(rank, world, port, args, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    try:
        subs = {tuple(range(world))}
        for _, u, r in layouts(world):
            task = Task(id=0, ranks=tuple(range(world)), seqs=(0,), ulysses=u, ring=r)
            for g in range(world):
                subs |= {task.ulysses_group(g), task.ring_group(g)}
        groups = {s: dist.new_group(list(s)) for s in sorted(subs) if len(s) > 1}
        rows = []
        with forced_backend(args.backend) if args.backend else _null():
            for n in args.lengths:
                for name, u, r in layouts(world):
                    rows.append((n, name, _time_one(rank, world, n, u, r, args, groups)))
        queue.put(rows if rank == 0 else None)
    finally:
        dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def kernel_table(args) -> None:
    """One process, no communication: the attention work of one rank of each 2-rank layout."""
    from megatron_dcp.runtime import kernels

    torch.set_num_threads(1)
    causal, scale = not args.non_causal, args.head_dim ** -0.5

    def timed(fn) -> list[float]:
        """Median time of ``fn`` with the exact and with the fused backend."""
        result = []
        for backend in ("torch", "sdpa"):
            with kernels.forced_backend(backend):
                fn()  # warm-up
                ts = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - start)
            result.append(statistics.median(ts))
        return result

    def rand(t, h):
        return torch.randn(t, h, args.head_dim, requires_grad=True)

    print("| tokens | work | exact kernel (s) | fused kernel (s) |\n| --- | --- | --- | --- |")
    for n in args.lengths:
        meta = ShardLayout.build([n], 1, 1, 0).meta()
        rows = []
        for label, heads, kv in (("degree 1 (all heads)", args.heads, args.kv_heads),
                                 ("ulysses 2 rank (half the heads)", args.heads // 2,
                                  args.kv_heads // 2)):
            q, k, v = rand(n, heads), rand(n, kv), rand(n, kv)
            rows.append((label, timed(lambda: kernels.local_attention(
                q, k, v, meta, causal=causal).sum().backward())))
        metas = [ShardLayout.build([n], 1, 2, j).meta() for j in range(2)]
        q, k, v = rand(n // 2, args.heads), rand(n // 2, args.kv_heads), rand(n // 2, args.kv_heads)

        def ring_rank0():
            """Ring rank 0 of 2: its zigzag half against both K/V blocks, forward + backward."""
            with torch.no_grad():
                out = lse = None
                for src in range(2):
                    o, l = kernels.block_forward(q, k, v, metas[0], metas[src], causal=causal,
                                                 scale=scale)
                    out, lse = kernels.merge_block(out, lse, o, l)
                for src in range(2):
                    kernels.block_backward(out, q, k, v, out, lse, metas[0], metas[src],
                                           causal=causal, scale=scale)
        rows.append(("ring 2 rank 0 (zigzag half, 2 blocks)", timed(ring_rank0)))
        for label, (exact, fused) in rows:
            print(f"| {n} | {label} | {exact:.3f} | {fused:.3f} |")


def main(argv=None) -> None:
    """Parse arguments, run all layouts in one launch, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--backend", choices=["torch", "sdpa"], default=None,
                   help="force the local backend (default: the process's choice)")
    p.add_argument("--kernels", action="store_true",
                   help="one process: per-rank attention work of each layout, exact vs fused")
    args = p.parse_args(argv)
    if args.kernels:
        return kernel_table(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_body, args=(r, args.world, port, args, queue))
             for r in range(args.world)]
    for proc in procs:
        proc.start()
    rows = [x for x in (queue.get() for _ in procs) if x is not None][0]
    for proc in procs:
        proc.join()
    print(f"world {args.world}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"{'non-causal' if args.non_causal else 'causal'}, float32, fwd+bwd, median of "
          f"{args.repeats}\n")
    print("| tokens | layout | time (s) | speed-up vs degree 1 |\n| --- | --- | --- | --- |")
    base = {}
    for n, name, sec in rows:
        base.setdefault(n, sec)
        print(f"| {n} | {name} | {sec:.3f} | {base[n] / sec:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
