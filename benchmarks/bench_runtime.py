#!/usr/bin/env python
"""Runtime benchmark: real 2-rank training steps of the reference decoder on a long-tailed batch.

    OMP_NUM_THREADS=1 python tools/profile_hardware.py --out runs/cpu-profile.json
    OMP_NUM_THREADS=1 python benchmarks/bench_runtime.py --hardware runs/cpu-profile.json

Plans compared side by side in one run (interleaved, same data, same processes):

* ``dcp``: `make_plan` with the DCP policy;
* ``fixed-2``: every sequence at degree 2 (Ulysses), packed into micro-batches: static context
  parallelism at degree 2;
* ``bucket``: `make_plan` with the bucket baseline.

For every plan: step time (slowest rank, barrier to barrier), tokens/s, and the cost model's
predicted task times (``Task.duration``, from the profile) against the measured ones (forward +
backward, slowest rank of the group), with the relative error. Writes a JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.models import Decoder, DecoderConfig  # noqa: E402
from megatron_dcp.plan import CostModel, Plan, Task, load_hardware, make_plan  # noqa: E402
from megatron_dcp.plan.memory import RESERVE_BYTES  # noqa: E402
from megatron_dcp.runtime.ports import free_port  # noqa: E402


def long_tailed_lengths(seed: int, scale: float) -> list[int]:
    """Many short sequences and a few long ones (the shape of real corpora)."""
    gen = torch.Generator().manual_seed(seed)
    longs = [3072, 1536, 1280]
    shorts = torch.exp(5.0 + 0.6 * torch.randn(40, generator=gen))  # log-normal, median ~150
    lengths = longs + [int(min(max(x, 16), 900)) for x in shorts.tolist()]
    return [max(16, int(n * scale)) for n in lengths]


def model_config(args: argparse.Namespace) -> DecoderConfig:
    """The benchmark's decoder (heads and KV heads divisible by 2: Ulysses 2 works)."""
    return DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                         num_heads=args.heads, num_kv_heads=args.kv_heads,
                         ffn_hidden_size=args.ffn, max_position=8192)


def cost_model(cfg: DecoderConfig, args: argparse.Namespace, world: int) -> CostModel:
    """The profile's cost model with a memory budget of ``--budget-tokens`` activation tokens
    per rank (this CPU has memory to spare; the budget makes long sequences need degree 2 as on
    a GPU)."""
    shape = Decoder(cfg).shape()
    hw = load_hardware(args.hardware)
    base = CostModel(shape, hw, world_size=world, memory_budget=1e15)
    mem = base.memory_model
    budget = mem.static_memory + RESERVE_BYTES + args.budget_tokens * mem.token_bytes(0)
    return CostModel(shape, hw, world_size=world, memory_budget=budget)


def fixed_degree_plan(lengths: list[int], cm: CostModel, world: int, degree: int,
                      pack_tokens: int) -> Plan:
    """Static context parallelism: every micro-batch (packed up to ``pack_tokens``) on
    ``degree`` ranks with Ulysses, the fewest recomputed layers that fit; groups of the world
    take micro-batches in turn."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    for i in order:
        for b in bins:
            if sum(lengths[j] for j in b) + lengths[i] <= pack_tokens:
                b.append(i)
                break
        else:
            bins.append([i])
    groups = [tuple(range(g, g + degree)) for g in range(0, world - degree + 1, degree)]
    clock = {g: 0.0 for g in groups}
    tasks = []
    for k, b in enumerate(bins):
        g = min(groups, key=lambda x: (clock[x], x))
        tokens = sum(lengths[i] for i in b)
        layers = cm.memory_model.min_recompute_layers(tokens, degree)
        if layers is None:
            raise SystemExit(f"fixed-{degree}: micro-batch of {tokens} tokens fits no recompute")
        probe = Task(id=k, ranks=g, seqs=tuple(b), ulysses=degree, ring=1, recompute_layers=layers)
        duration = cm.time_model.task_time(probe, lengths)
        tasks.append(Task(id=k, ranks=g, seqs=tuple(b), ulysses=degree, ring=1,
                          recompute_layers=layers, start=clock[g], duration=duration))
        clock[g] += duration
    return Plan(tasks=tuple(tasks), lengths=tuple(lengths), world_size=world,
                policy=f"fixed-{degree}")


def build_plans(args: argparse.Namespace, world: int) -> dict[str, Plan]:
    """The three plans of the comparison (deterministic: every rank builds the same)."""
    cfg = model_config(args)
    lengths = long_tailed_lengths(args.seed, args.scale)
    cm = cost_model(cfg, args, world)
    shape = Decoder(cfg).shape()
    plans = {"dcp": make_plan(lengths, world_size=world, model=shape,
                              config=DCPConfig(policy="dcp"), cost_model=cm)}
    plans["fixed-2"] = fixed_degree_plan(lengths, cm, world, 2, args.budget_tokens * 2)
    plans["bucket"] = make_plan(lengths, world_size=world, model=shape,
                                config=DCPConfig(policy="bucket"), cost_model=cm)
    return plans


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist

    from megatron_dcp.runtime.executor import reduce_gradients, run_plan
    from megatron_dcp.runtime.groups import GroupPool

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    try:
        cfg = model_config(args)
        model = Decoder(cfg, seed=0)
        plans = build_plans(args, world)
        gen = torch.Generator().manual_seed(1)
        lengths = next(iter(plans.values())).lengths
        batch = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
        pool = GroupPool()

        def shard_loss(shard):
            return model.loss(shard.input_ids, shard.position_ids, shard.labels, task=shard.task)

        for plan in plans.values():
            pool.ensure(plan)
        records: dict[str, list] = {name: [] for name in plans}
        for rep in range(args.warmup + args.steps):
            for name, plan in plans.items():
                dist.barrier()
                t0 = time.perf_counter()
                stats = run_plan(plan, batch, rank, shard_loss, pool=pool,
                                 max_position=cfg.max_position)
                reduce_gradients(list(model.parameters()), pool.world_group)
                model.zero_grad(set_to_none=True)
                dist.barrier()
                step = time.perf_counter() - t0
                if rep >= args.warmup:
                    records[name].append({"step_s": step, "loss": stats.loss, "tasks": [
                        (t.task_id, t.total_s, t.predicted_s) for t in stats.tasks]})
                if rank == 0:
                    print(f"  rep {rep} {name:8s} step {step:7.3f} s  loss {stats.loss:.4f}",
                          flush=True)
        gathered = [None] * world
        dist.all_gather_object(gathered, records)
        if rank == 0:
            with open(out_path, "w") as handle:
                json.dump({"records": gathered,
                           "plans": {n: p.to_dict() for n, p in plans.items()}}, handle)
    finally:
        dist.destroy_process_group()


def summarise(raw: dict, world: int) -> dict:
    """Per plan: median step time, tokens/s, predicted vs measured task times."""
    out = {}
    for name, plan_d in raw["plans"].items():
        plan = Plan.from_dict(plan_d)
        tokens = sum(plan.lengths[s] for t in plan.tasks for s in t.seqs)
        steps = [max(raw["records"][r][name][k]["step_s"] for r in range(world))
                 for k in range(len(raw["records"][0][name]))]
        measured: dict[int, list[float]] = {}
        for r in range(world):
            for rec in raw["records"][r][name]:
                for task_id, seconds, _ in rec["tasks"]:
                    measured.setdefault(task_id, []).append(seconds)
        errors, task_rows = [], []
        for t in plan.tasks:
            # slowest rank of the group, median over steps
            per_step = len(raw["records"][0][name])
            vals = measured[t.id]
            slowest = [max(vals[k::per_step]) for k in range(per_step)] if per_step else vals
            m = statistics.median(slowest)
            errors.append(t.duration / m - 1.0)
            task_rows.append({"id": t.id, "degree": t.degree,
                              "tokens": sum(plan.lengths[s] for s in t.seqs),
                              "recompute_layers": t.recompute_layers,
                              "predicted_s": t.duration, "measured_s": m})
        step = statistics.median(steps)
        out[name] = {"step_s": step, "tokens_per_s": tokens / step, "tasks": len(plan.tasks),
                     "loss": raw["records"][0][name][0]["loss"],
                     "degrees": sorted({t.degree for t in plan.tasks}),
                     "predicted_makespan_s": plan.makespan,
                     "mean_abs_task_error": statistics.mean(abs(e) for e in errors),
                     "max_abs_task_error": max(abs(e) for e in errors),
                     "task_rows": task_rows}
    # One machine-wide scale factor (what online refinement from measured step times learns):
    # how well the model ranks and proportions tasks once its absolute speed is corrected.
    ratios = [r["measured_s"] / r["predicted_s"] for row in out.values() for r in row["task_rows"]]
    scale = statistics.median(ratios)
    for row in out.values():
        errs = [r["predicted_s"] * scale / r["measured_s"] - 1.0 for r in row["task_rows"]]
        row["scale"] = scale
        row["mean_abs_task_error_scaled"] = statistics.mean(abs(e) for e in errs)
        row["max_abs_task_error_scaled"] = max(abs(e) for e in errs)
    return out


def main(argv=None) -> int:
    """Parse flags, spawn the ranks, print and write the summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", required=True, help="profile JSON from tools/profile_hardware.py")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--budget-tokens", type=int, default=2048,
                   help="activation tokens per rank the planner may hold (memory budget)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="runs/bench_runtime.json")
    args = p.parse_args(argv)

    import torch.multiprocessing as mp

    plans = build_plans(args, args.world)
    for name, plan in plans.items():
        print(f"{name}: {len(plan.tasks)} tasks, degrees {sorted({t.degree for t in plan.tasks})}, "
              f"predicted makespan {plan.makespan:.2f} s")
    port = free_port()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    raw_path = args.out + ".raw"
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(args.world, port, args, raw_path), nprocs=args.world)
    with open(raw_path) as handle:
        raw = json.load(handle)
    summary = summarise(raw, args.world)
    with open(args.out, "w") as handle:
        json.dump({"args": vars(args), "summary": summary, "wall_s": time.perf_counter() - t0},
                  handle, indent=1)
    dcp = summary["dcp"]["tokens_per_s"]
    print("losses (equal: every plan computes the same step): "
          + ", ".join(f"{n} {row['loss']:.6f}" for n, row in summary.items()))
    print("\n| plan | tasks | degrees | step (s) | tokens/s | vs DCP | predicted makespan (s) | "
          "task time error mean / max | after one scale factor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in summary.items():
        print(f"| {name} | {row['tasks']} | {row['degrees']} | {row['step_s']:.2f} | "
              f"{row['tokens_per_s']:.0f} | {row['tokens_per_s'] / dcp:.2f} | "
              f"{row['predicted_makespan_s']:.2f} | {row['mean_abs_task_error'] * 100:.0f} % / "
              f"{row['max_abs_task_error'] * 100:.0f} % | "
              f"{row['mean_abs_task_error_scaled'] * 100:.0f} % / "
              f"{row['max_abs_task_error_scaled'] * 100:.0f} % (x{row['scale']:.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
