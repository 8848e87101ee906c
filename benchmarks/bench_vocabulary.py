#!/usr/bin/env python
"""Group vocabulary chosen from the data vs the default one (issue 21): communicators per rank
and DCP plan efficiency (lower bound / simulated step) per batch, llama-7b.

    python benchmarks/bench_vocabulary.py [--gpus 32 64] [--hardware h200]

The batches are `bench_planner.batches` (seeds 0-2). Each distribution's vocabulary is chosen
(`megatron_dcp.plan.planners.vocabulary_for_lengths`) from lengths the measured batches do not
hold: three batches of the
same distribution with seeds 10-12, or every document of the embedded corpus. Both plans are
measured against the same lower bound (the default vocabulary's, with its communicators charged).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_planner import batches, corpus_lengths  # noqa: E402

from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.plan.planners import vocabulary_for_lengths  # noqa: E402
from megatron_dcp.plan import (Vocabulary, build_cost_model, load_model, lower_bound,  # noqa: E402
                               make_plan, simulate)
from megatron_dcp.plan.workload import sample_lengths  # noqa: E402


def job_lengths(kind: str, world: int) -> list[int]:
    """The lengths the job would be started with for batches of ``kind``."""
    if kind == "corpus":
        return corpus_lengths()
    dist, _, cap = kind.partition("-")
    per_gpu, max_len = (262144, 262144) if cap else (65536, 131072)
    return [n for seed in (10, 11, 12)
            for n in sample_lengths(dist, per_gpu * world, seed=seed, max_len=max_len)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[32, 64])
    p.add_argument("--hardware", default="h200")
    args = p.parse_args()
    model = load_model("llama-7b")
    cfg = DCPConfig(hardware=args.hardware)
    for world in args.gpus:
        cm = build_cost_model(model, cfg, world)
        print(f"{world} ranks, default: {Vocabulary.for_cost_model(cm).describe()}")
        vocabs: dict[str, Vocabulary] = {}
        for name, lengths in batches(world).items():
            kind = name.split("/")[0]
            if kind not in vocabs:
                vocabs[kind] = vocabulary_for_lengths(cm, job_lengths(kind, world))
                print(f"  {kind}: {vocabs[kind].describe()}")
            row = f"{world:>5} {name:<18} {len(lengths):>5}"
            bound = None
            for vocab in (None, vocabs[kind]):
                vcm = build_cost_model(model, cfg, world, vocabulary=vocab)
                plan = make_plan(lengths, world_size=world, model=model, config=cfg,
                                 cost_model=vcm, vocabulary=vocab)
                if bound is None:
                    ran = [lengths[s] for t in plan.tasks for s in t.seqs]
                    bound = lower_bound(ran, cm, world_size=world)
                r = simulate(plan, vcm, bound=bound)
                row += f"  {r.efficiency:.3f} ({vcm.memory_model.communicators.per_rank} comm)"
            print(row, flush=True)


if __name__ == "__main__":
    main()
