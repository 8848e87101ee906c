#!/usr/bin/env python
"""Process groups of the plan vocabulary: how many communicators a job holds, and what creating
them at start-up costs.

    OMP_NUM_THREADS=1 python benchmarks/bench_groups.py

Part 1 (pure Python, any cluster size): for 32, 256 and 1,024 ranks (8 per node) and the model's
heads, the vocabulary's task groups and its communicators (task groups plus the Ulysses and ring
sub-groups of every layout the planner may choose), in all and per rank (max and mean), for

* ``every degree``: sub-groups for every Ulysses degree dividing a group (what the pool created
  before the vocabulary knew the model's heads);
* ``default``: the Ulysses degrees the model's heads allow (``ulysses_scope="any"``);
* ``node``: Ulysses only inside a node, ring across nodes (``ulysses_scope="node"``).

Part 2 (simulator, same cost model for both): the DCP step time of the default and the ``node``
vocabulary on the same global batches (``--tokens-per-rank`` per rank, ``short`` and ``long``
distributions, seed 0): what the smaller vocabulary costs the plans.

Part 3 (real processes on gloo): ``GroupPool.create_all`` of the default vocabulary at
``--gloo-world`` ranks (``--gloo-ranks-per-node`` per node for the vocabulary), creation and
warm-up seconds of the slowest rank, median of ``--repeats`` fresh pools in the same processes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.plan import (Vocabulary, build_cost_model, load_model, make_plan,  # noqa: E402
                               simulate)
from megatron_dcp.plan.workload import sample_lengths  # noqa: E402
from megatron_dcp.runtime.ports import free_port  # noqa: E402


def vocabularies(model_name: str, world: int, per_node: int) -> dict[str, Vocabulary]:
    """The three vocabularies of the module docstring for one cluster size."""
    model = load_model(model_name)
    out = {"every degree": Vocabulary(world, per_node)}
    for scope in ("any", "node"):
        config = DCPConfig(ranks_per_node=per_node, ulysses_scope=scope)
        cm = build_cost_model(model, config, world)
        out["default" if scope == "any" else "node"] = Vocabulary.for_cost_model(cm)
    return out


def count_table(model_name: str, worlds: list[int], per_node: int) -> str:
    """Markdown table of part 1."""
    rows = ["| ranks | vocabulary | task groups | communicators | per rank (max) | "
            "per rank (mean) |", "| --- | --- | --- | --- | --- | --- |"]
    for world in worlds:
        for name, vocab in vocabularies(model_name, world, per_node).items():
            comms = vocab.communicators()
            mean = sum(len(g) for g in comms) / world
            rows.append(f"| {world} | {name} | {len(vocab)} | {len(comms)} | "
                        f"{vocab.communicators_per_rank()} | {mean:.1f} |")
    return "\n".join(rows)


def scope_cost_table(model_name: str, worlds: list[int], per_node: int,
                     tokens_per_rank: int) -> str:
    """Markdown table: simulated DCP step time with Ulysses anywhere vs only inside a node, on the
    same global batches (what the smaller vocabulary costs the plans)."""
    model = load_model(model_name)
    rows = ["| ranks | distribution | step s, default | step s, node | node / default |",
            "| --- | --- | ---: | ---: | ---: |"]
    for world in worlds:
        for dist in ("short", "long"):
            lengths = sample_lengths(dist, world * tokens_per_rank, seed=0)
            steps = []
            for scope in ("any", "node"):
                config = DCPConfig(ranks_per_node=per_node, ulysses_scope=scope)
                cm = build_cost_model(model, config, world)
                plan = make_plan(lengths, world_size=world, model=model, config=config,
                                 cost_model=cm)
                steps.append(simulate(plan, cm).step_time_s)
            rows.append(f"| {world} | {dist} | {steps[0]:.2f} | {steps[1]:.2f} | "
                        f"{steps[1] / steps[0]:.3f} |")
    return "\n".join(rows)


def _rank_body(rank: int, world: int, per_node: int, port: int, model_name: str, repeats: int,
               results) -> None:
    """One gloo rank: ``repeats`` fresh pools, each ``create_all`` of the default vocabulary."""
    import torch.distributed as dist

    from megatron_dcp.runtime.groups import GroupPool

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        vocab = vocabularies(model_name, world, per_node)["default"]
        runs = []
        for _ in range(repeats):
            pool = GroupPool()
            pool.create_all(vocab)
            runs.append(pool.startup)
        results.put((rank, runs))
    finally:
        dist.destroy_process_group()


def gloo_startup(world: int, per_node: int, model_name: str,
                 repeats: int) -> list[list[dict]]:
    """Per-rank ``GroupPool.startup`` records of ``repeats`` pools at ``world`` gloo ranks."""
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_body, args=(r, world, per_node, port, model_name, repeats,
                                                     results))
             for r in range(world)]
    for p in procs:
        p.start()
    runs = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return [runs[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--worlds", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--gloo-world", type=int, nargs="*", default=[4],
                        help="ranks of part 2 (none: skip it)")
    parser.add_argument("--gloo-ranks-per-node", type=int, default=4,
                        help="ranks per node of part 2's vocabulary (this machine is one node)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens-per-rank", type=int, default=65536,
                        help="global batch per rank of the simulated comparison (0: skip it)")
    args = parser.parse_args()
    print(f"## Communicators of the vocabulary, {args.model}, {args.ranks_per_node} ranks per "
          "node\n")
    print(count_table(args.model, args.worlds, args.ranks_per_node))
    if args.tokens_per_rank:
        print(f"\n## Simulated DCP step, {args.model} on H200, {args.tokens_per_rank} tokens per "
              "rank, Ulysses anywhere (default) vs inside a node\n")
        print(scope_cost_table(args.model, args.worlds, args.ranks_per_node,
                               args.tokens_per_rank))
    for world in args.gloo_world:
        per_node = min(world, args.gloo_ranks_per_node)
        per_rank = gloo_startup(world, per_node, args.model, args.repeats)
        first = per_rank[0][0]
        # the slowest rank decides when the job can start
        create = statistics.median(max(r[i]["create_s"] for r in per_rank)
                                   for i in range(args.repeats))
        warm = statistics.median(max(r[i]["warm_s"] for r in per_rank)
                                 for i in range(args.repeats))
        print(f"\n## GroupPool.create_all on gloo, {world} ranks ({per_node} per node), "
              f"{args.model}\n")
        print(f"{first['communicators']} communicators, at most {first['max_per_rank']} per "
              f"rank; created in {create:.3f} s, warmed in {warm:.3f} s (slowest rank, median "
              f"of {args.repeats} fresh pools)")

if __name__ == "__main__":
    main()
