#!/usr/bin/env python
"""DCP plan efficiency (lower bound / simulated step) per batch under a hardware preset and under
equal attention rates per layout, and lockstep vs free planning time (issue 21).

    python benchmarks/bench_planner.py efficiency [--gpus 32 64] [--hardware h200 PROFILE.json]
    python benchmarks/bench_planner.py timing [--gpus 256 1024] [--repeat 3]

Batches: ``short``, ``balanced`` and ``long`` (65,536 tokens per GPU, 128k longest, seeds 0-2),
long documents (``long``/``balanced`` with 262,144 tokens per GPU and sequences up to 256k), and
batches of the embedded corpus's document lengths (byte tokens, sampled to 65,536 per GPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.plan import build_cost_model, load_model, lower_bound, make_plan  # noqa: E402
from megatron_dcp.plan import simulate  # noqa: E402
from megatron_dcp.plan.workload import sample_lengths  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "megatron_dcp", "data",
                      "corpus", "pystdlib.jsonl.gz")


def corpus_lengths() -> list[int]:
    """Byte lengths of the embedded corpus's documents."""
    with gzip.open(CORPUS, "rt") as handle:
        return [len(json.loads(line)["text"].encode()) for line in handle]


def batches(world: int, seeds=(0, 1, 2)) -> dict[str, list[int]]:
    """Named batches for ``world`` ranks."""
    out = {}
    for seed in seeds:
        for dist in ("short", "balanced", "long"):
            out[f"{dist}/s{seed}"] = sample_lengths(dist, 65536 * world, seed=seed)
        for dist in ("balanced", "long"):
            out[f"{dist}-256k/s{seed}"] = sample_lengths(dist, 262144 * world, seed=seed,
                                                         max_len=262144)
    docs = corpus_lengths()
    for seed in seeds:
        rng = random.Random(f"corpus:{seed}")
        lengths, total = [], 0
        while total < 65536 * world:
            n = docs[rng.randrange(len(docs))]
            lengths.append(n)
            total += n
        out[f"corpus/s{seed}"] = lengths
    return out


def efficiency(lengths: list[int], world: int, hardware: str, **config) -> tuple[float, float]:
    """(efficiency, imbalance) of the dcp plan of ``lengths``."""
    model = load_model("llama-7b")
    cfg = DCPConfig(hardware=hardware, **config)
    cm = build_cost_model(model, cfg, world)
    plan = make_plan(lengths, world_size=world, model=model, config=cfg, cost_model=cm)
    ran = [lengths[s] for t in plan.tasks for s in t.seqs]
    bound = lower_bound(ran, cm, world_size=world)
    r = simulate(plan, cm, bound=bound)
    return r.efficiency, r.imbalance, cm.memory_model.communicators_per_rank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("efficiency", "timing"))
    p.add_argument("--gpus", type=int, nargs="+", default=None)
    p.add_argument("--hardware", nargs="+", default=["h200"])
    p.add_argument("--only", default=None, help="substring of the batch names to run")
    p.add_argument("--repeat", type=int, default=3,
                   help="timing: plan this many times, report the least CPU time")
    args = p.parse_args()
    if args.what == "efficiency":
        for world in args.gpus or (32, 64):
            for name, lengths in batches(world).items():
                if args.only and args.only not in name:
                    continue
                row = [f"{world:>5} {name:<18} {len(lengths):>5}"]
                for hw in args.hardware:
                    e, imb, comms = efficiency(lengths, world, hw)
                    row.append(f"{e:.3f} ({imb:+.3f}, {comms} comm)")
                print("  ".join(row), flush=True)
    else:
        model = load_model("llama-7b")
        for world in args.gpus or (256, 1024):
            n = 4000 if world <= 256 else 16000
            lengths = sample_lengths("short", n * 200_000, seed=0)[:n]
            setups = {}
            for schedule in ("free", "lockstep"):
                cfg = DCPConfig(hardware=args.hardware[0], schedule=schedule)
                setups[schedule] = (cfg, build_cost_model(model, cfg, world))
            times = {schedule: float("inf") for schedule in setups}
            for _ in range(args.repeat):  # alternated: a busy moment of the machine hits both
                for schedule, (cfg, cm) in setups.items():
                    t = time.process_time()
                    make_plan(lengths, world_size=world, model=model, config=cfg, cost_model=cm)
                    times[schedule] = min(times[schedule], time.process_time() - t)
            print(f"{world} ranks, {n} seqs: " + " ".join(f"{k} {v * 1e3:.0f} ms"
                                                         for k, v in times.items())
                  + f" ratio {times['lockstep'] / times['free']:.2f}", flush=True)


if __name__ == "__main__":
    main()
