#!/usr/bin/env python
"""Bytes each rank receives per step for the global batch of the Megatron-LM launcher (before and
after `megatron_dcp.megatron.lm_data`, issue 43 item 5) and of the DeepSpeed plugin (before and
after ``train_step(share, local=True)``, issue 58 item 2), both the runtime's input stage
(`megatron_dcp.runtime.input_stage`), from the planner's own plan (no processes run).

    python benchmarks/bench_launcher_data.py [--gpus 64 1024] [--dist long] [--engine deepspeed]

Before: every rank received every source's documents through ``all_gather_object``: pickles of
int64 arrays, each source's padded to the largest (gloo and NCCL move ``world x largest``).
After: a pickled list of lengths from every rank (``all_gather_object``, also padded to the
largest), then one ``all_to_all_single`` bringing each rank the int64 tokens of its own tasks'
documents. Reported per rank: the tokens it runs (its tasks' documents' tokens), the bytes it
receives before and after (median and maximum over ranks), after as a multiple of 8 bytes x the
tokens it runs.

DeepSpeed (``--engine deepspeed``): every rank is a source (its own share, rank order), the
lengths gather also carries each share's next lengths (the plan made ahead). Before: the whole
batch handed to ``train_step`` on every rank (8 B x every token of the batch a rank).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.runtime.input_stage import needed_by  # noqa: E402
from megatron_dcp.plan import load_model, make_plan  # noqa: E402
from megatron_dcp.plan.workload import sample_lengths  # noqa: E402


def measure(world: int, dist: str, tokens_per_gpu: int, seed: int,
            engine: str = "launcher") -> dict:
    lengths = sample_lengths(dist, world * tokens_per_gpu, seed=seed, max_len=131072)
    plan = make_plan(lengths, world_size=world, model=load_model("llama-7b"),
                     config=DCPConfig(enabled=True, hardware="h200"), zero_stage=1)
    # each data-parallel rank's source holds an equal share of documents, in order
    share = np.array_split(np.arange(len(lengths)), world)
    per_source = [len(pickle.dumps((r, [np.zeros(lengths[i], np.int64) for i in docs])))
                  for r, docs in enumerate(share)]
    before = world * max(per_source)  # all_gather_object: every part padded to the largest
    if engine == "deepspeed":  # the whole batch given to train_step on every rank
        before = 8 * sum(lengths)
    # what each rank says in the lengths gather (`input_stage.gather_lengths`): DeepSpeed's
    # shares also carry their next lengths (the same count, planned ahead)
    said = [len(pickle.dumps((r, (r, [lengths[i] for i in docs], "",
                                  [lengths[i] for i in docs] if engine == "deepspeed"
                                  else None)))) for r, docs in enumerate(share)]
    gather = world * max(said)
    needs = needed_by(plan, list(range(world)))
    runs = [0] * world
    for s, ranks in enumerate(needs):
        for g in ranks:
            runs[g] += lengths[s]
    after = [gather + 8 * n for n in runs]
    ratio = [a / (8 * n) for a, n in zip(after, runs) if n]
    return {"world": world, "dist": dist, "tokens": sum(lengths), "documents": len(lengths),
            "runs_median": statistics.median(runs), "before_bytes": before,
            "after_median": statistics.median(after), "after_max": max(after),
            "after_over_runs_max": max(ratio), "after_over_runs_median": statistics.median(ratio)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--dist", default="long")
    p.add_argument("--tokens-per-gpu", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("launcher", "deepspeed"), default="launcher",
                   help="whose input stage: the Megatron-LM launcher's, or the DeepSpeed "
                        "plugin's train_step(share, local=True)")
    a = p.parse_args()
    print("| GPUs | batch tokens | documents | before MiB/rank | after MiB/rank (median, max) "
          "| after / 8 B x tokens run (median, max) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for world in a.gpus:
        r = measure(world, a.dist, a.tokens_per_gpu, a.seed, a.engine)
        print(f"| {world} | {r['tokens']:,} | {r['documents']:,} | "
              f"{r['before_bytes'] / 2**20:,.1f} | {r['after_median'] / 2**20:.2f}, "
              f"{r['after_max'] / 2**20:.2f} | {r['after_over_runs_median']:.2f}, "
              f"{r['after_over_runs_max']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
