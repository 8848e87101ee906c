"""Attention benchmarks on CPU: layouts on gloo ranks, kernels before/after, video memory.

    OMP_NUM_THREADS=1 python benchmarks/bench_attention.py --world 2 --lengths 1024 2048 4096
    OMP_NUM_THREADS=1 python benchmarks/bench_attention.py --kernels --baseline REV
    OMP_NUM_THREADS=1 python benchmarks/bench_attention.py --video --baseline REV

Default: for each length, one sequence runs at degree 1 (on rank 0; the other ranks wait), then
with every layout of ``--world`` ranks (Ulysses, ring, hybrid where the world allows). Reported:
median over ``--repeats`` of the slowest rank's forward+backward time of that one sequence, and
the speed-up over degree 1 (ideal: the number of ranks, while ranks <= cores).
``--kernels``: in one process, the attention work of every rank of each layout with the kernels
of git revision ``--baseline`` and with the current ones, same inputs, plus their errors against
torch's SDPA in float64. ``--video``: peak memory of one video task (attention groups) before and
after, each in a fresh process. Every mode writes Markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.multiprocessing as mp

from megatron_dcp.plan.plan import Task
from megatron_dcp.runtime.attention import dcp_attention
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.kernels import forced_backend
from megatron_dcp.runtime.layout import ShardLayout
from megatron_dcp.runtime.ports import free_port
from megatron_dcp.runtime.ring import ring_in_one_process


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
            dcp_attention(q, k, v, causal=not args.non_causal, task=ctx).sum().backward()
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


def _baseline_kernels(rev: str):
    """The ``kernels`` module of git revision ``rev`` (its fused path lived in ``pairs.py``),
    imported from a temporary package, for before/after comparisons in one process."""
    import importlib
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pkg = os.path.join(tempfile.mkdtemp(prefix="dcp_baseline_"), "dcp_baseline")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for name in ("kernels", "pairs"):
        src = subprocess.run(["git", "-C", root, "show", f"{rev}:megatron_dcp/runtime/{name}.py"],
                             capture_output=True, text=True, check=True).stdout
        src = src.replace("from megatron_dcp.runtime import pairs as",
                          "from dcp_baseline import pairs as")
        with open(os.path.join(pkg, f"{name}.py"), "w") as f:
            f.write(src)
    sys.path.insert(0, os.path.dirname(pkg))
    return importlib.import_module("dcp_baseline.kernels")


def _local_task(mod, lengths, q, k, v, dout, causal, scale):
    """Degree 1: `local_attention` over the packed sequences, through autograd."""
    meta = ShardLayout.build(lengths, 1, 1, 0).meta()
    with torch.enable_grad():
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mod.local_attention(*ins, meta, causal=causal, softmax_scale=scale)
        return [out.detach(), *torch.autograd.grad(out, ins, dout)]


def _reference(lengths, q, k, v, dout, causal, scale):
    """One float64 SDPA call per whole sequence (torch's own kernel): ``out, dq, dk, dv``."""
    ins = [t.double().requires_grad_() for t in (q, k, v)]
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        qs, ks, vs = (t[sl].transpose(0, 1).unsqueeze(0) for t in ins)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale,
                                                   enable_gqa=True)[0].transpose(0, 1))
        start += n
    out = torch.cat(outs)
    return [out.detach(), *torch.autograd.grad(out, ins, dout.double())]


def _rel_err(got, want) -> float:
    return max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


def kernel_table(args) -> None:
    """One process: all ranks' attention work of ring/hybrid layouts and of degree 1, before
    (``--baseline`` revision) and after, same inputs, interleaved, thread CPU time."""
    from megatron_dcp.runtime import kernels

    torch.set_num_threads(1)
    before = _baseline_kernels(args.baseline) if args.baseline else None
    causal, scale = not args.non_causal, args.head_dim ** -0.5
    print(f"heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"{'non-causal' if args.non_causal else 'causal'}, float32, forward+backward of every "
          f"rank in one process, min of {args.repeats} (thread CPU time); error: max relative "
          f"error of out/dq/dk/dv vs one float64 SDPA call per sequence\n")
    print("| sequences | layout | before (s) | after (s) | before / after | error before | "
          "error after |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for spec in args.packs:
        count, _, size = spec.rpartition("x")
        lengths = [int(x) for x in size.split(",")] * int(count or 1)
        n = sum(lengths)
        gen = torch.Generator().manual_seed(0)
        q, dout = (torch.randn(n, args.heads, args.head_dim, generator=gen) for _ in range(2))
        k, v = (torch.randn(n, args.kv_heads, args.head_dim, generator=gen) for _ in range(2))
        want = _reference(lengths, q, k, v, dout, causal, scale)
        for name, u, r in (("degree 1", 1, 1), ("ring 2", 1, 2), ("ring 4", 1, 4),
                           ("hybrid 2x2", 2, 2)):
            mods = [m for m in (before, kernels) if m is not None]
            times = {id(m): [] for m in mods}
            errs = {}
            for rep in range(args.repeats + 1):  # the first round warms up
                for m in mods:
                    with m.forced_backend("sdpa"), torch.no_grad():
                        start = time.thread_time()
                        got = (_local_task(m, lengths, q, k, v, dout, causal, scale)
                               if u * r == 1 else
                               ring_in_one_process(q, k, v, lengths, u, r, causal=causal,
                                                   scale=scale, dout=dout, blocks=m))
                        if rep:
                            times[id(m)].append(time.thread_time() - start)
                    errs[id(m)] = _rel_err(got, want)
            t_after, e_after = min(times[id(kernels)]), errs[id(kernels)]
            if before is None:
                print(f"| {spec} | {name} | - | {t_after:.3f} | - | - | {e_after:.1e} |")
            else:
                t_before, e_before = min(times[id(before)]), errs[id(before)]
                print(f"| {spec} | {name} | {t_before:.3f} | {t_after:.3f} | "
                      f"{t_before / t_after:.2f} | {e_before:.1e} | {e_after:.1e} |")


def video_child(args) -> None:
    """One video task (local attention with attention groups, forward + backward) in this fresh
    process; prints JSON: peak RSS growth (MiB) and thread CPU time."""
    import json
    import resource

    from megatron_dcp.models.dit import CellOf, FrameOf
    from megatron_dcp.runtime import kernels

    torch.set_num_threads(1)
    mod = _baseline_kernels(args.baseline) if args.video_child == "before" else kernels
    frame = args.frame_tokens
    n = args.video_frames * frame
    meta = ShardLayout.build([n], 1, 1, 0).meta()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, args.heads, args.head_dim, generator=gen, requires_grad=True)
    k = torch.randn(n, args.kv_heads, args.head_dim, generator=gen, requires_grad=True)
    v = torch.randn(n, args.kv_heads, args.head_dim, generator=gen, requires_grad=True)
    fn = (CellOf if args.video_kind == "temporal" else FrameOf)(frame)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.thread_time()
    with mod.forced_backend("sdpa"):
        out = mod.local_attention(q, k, v, meta, causal=False,
                                  groups=mod.attention_groups(fn, meta))
        out.backward(torch.ones_like(out))
    seconds = time.thread_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": (peak - base) / 1024, "seconds": seconds,
                      "checksum": float(q.grad.double().abs().sum())}))


def video_table(args) -> None:
    """Peak memory of one video task before and after, each in a fresh process."""
    import json
    import subprocess

    print(f"video: {args.video_frames} frames x {args.frame_tokens} tokens = "
          f"{args.video_frames * args.frame_tokens} tokens, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, float32, non-causal, forward+backward, one process each\n")
    print("| attention groups | code | peak RSS growth (MiB) | time (s) |\n"
          "| --- | --- | ---: | ---: |")
    for kind in ("spatial", "temporal"):
        sums = []
        for which in ("before", "after"):
            cmd = [sys.executable, __file__, "--video-child", which, "--video-kind", kind,
                   "--baseline", args.baseline, "--video-frames", str(args.video_frames),
                   "--frame-tokens", str(args.frame_tokens), "--heads", str(args.heads),
                   "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim)]
            res = json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                            check=True).stdout.strip().splitlines()[-1])
            sums.append(res["checksum"])
            print(f"| {kind} | {which} | {res['peak_mib']:.0f} | {res['seconds']:.2f} |")
        if abs(sums[0] - sums[1]) > 1e-4 * abs(sums[0]):
            raise SystemExit(f"video {kind}: gradients differ before/after: {sums}")


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
                   help="one process: all ranks' attention work per layout, before vs after")
    p.add_argument("--packs", nargs="+", default=["4096", "8x1024"],
                   help="--kernels: packed tasks, 'N' (one sequence) or 'CxN' (C sequences)")
    p.add_argument("--baseline", default=None,
                   help="git revision whose runtime/kernels.py (and pairs.py) is 'before'")
    p.add_argument("--video", action="store_true",
                   help="peak memory and time of one video task, before vs after "
                   "(needs --baseline)")
    p.add_argument("--video-frames", type=int, default=16)
    p.add_argument("--frame-tokens", type=int, default=1024)
    p.add_argument("--video-kind", choices=["spatial", "temporal"], default="spatial")
    p.add_argument("--video-child", choices=["before", "after"], default=None,
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.video_child:
        return video_child(args)
    if args.video:
        return video_table(args)
    if args.kernels:
        return kernel_table(args)
    port = free_port()
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
