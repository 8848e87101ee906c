"""Simulated cost of lockstep schedules (ZeRO-2/3 keep their sharding) against free DCP.

  python benchmarks/bench_lockstep.py                  # the tables of docs/BENCHMARKS.md
  python benchmarks/bench_lockstep.py --json out.json

For each length distribution (short, balanced, long) and DCP world (32, 256 H200, 8 per node,
65,536 tokens per GPU, llama-7b), one global batch is planned and simulated by the same cost
model with:

* ``free``: free DCP at ZeRO-1 memory (what ``--dcp`` ran before for every stage: ZeRO-2 with one
  coalesced reduction, ZeRO-3 with parameters kept gathered);
* ``lockstep ZeRO-2`` / ``lockstep ZeRO-3``: the lockstep planner with the stage's sharded memory
  and its per-slot traffic (`TimeModel.slot_time`);
* ``bucket ZeRO-3``: the bucket baseline in lockstep slots, for reference.

Then llama-70b on 256 H200 with ZeRO-3: a free schedule does not fit (140 GB of parameters on
every rank), a lockstep one plans and fits. Numbers are step times (makespan + gradient sync),
``efficiency`` = lower bound / step time (the bound of the schedule's own memory model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.plan import (PlanError, build_cost_model, load_model, make_plan,  # noqa: E402
                               simulate, validate_plan)
from megatron_dcp.plan.workload import sample_lengths  # noqa: E402

RUNS = (("free", 1, "free", "dcp"), ("lockstep ZeRO-2", 2, "lockstep", "dcp"),
        ("lockstep ZeRO-3", 3, "lockstep", "dcp"), ("bucket ZeRO-3", 3, "lockstep", "bucket"))


def one(model, lengths, world: int, zero: int, schedule: str, policy: str) -> dict:
    """Plan and simulate one global batch; the row of one run."""
    config = DCPConfig(policy=policy, schedule=schedule)
    cm = build_cost_model(model, config, world, zero_stage=zero)
    t0 = time.perf_counter()
    plan = make_plan(lengths, world_size=world, model=model, config=config, zero_stage=zero,
                     cost_model=cm)
    plan_ms = (time.perf_counter() - t0) * 1e3
    validate_plan(plan, model, cost_model=cm)
    r = simulate(plan, cm)
    return {"step_s": r.step_time_s, "efficiency": r.efficiency, "tokens_per_s": r.tokens_per_s,
            "slots": len(plan.slot_recompute_layers()), "tasks": len(plan.tasks),
            "plan_ms": plan_ms,
            "peak_task_gib": max(t.memory for t in plan.tasks) / 2**30,
            "static_gib": cm.memory_model.static_memory / 2**30,
            "budget_gib": cm.memory_model.budget / 2**30,
            "candidate": plan.meta.get("candidate")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write every row as JSON here")
    args = p.parse_args(argv)
    llama = load_model("llama-7b")
    rows = {}
    print("| ranks | distribution | " + " | ".join(name for name, *_ in RUNS)
          + " | lockstep ZeRO-3 / free | slots (ZeRO-3) | plan ms (ZeRO-3) |")
    print("| --- | --- |" + " --- |" * (len(RUNS) + 3))
    for world in (32, 256):
        for dist in ("short", "balanced", "long"):
            lengths = sample_lengths(dist, world * 65536, seed=0)
            got = {name: one(llama, lengths, world, zero, schedule, policy)
                   for name, zero, schedule, policy in RUNS}
            rows[f"{world}/{dist}"] = got
            z3, free = got["lockstep ZeRO-3"], got["free"]
            cells = [f"{got[name]['step_s']:.2f} s ({got[name]['efficiency']:.2f})"
                     for name, *_ in RUNS]
            print(f"| {world} | {dist} | " + " | ".join(cells)
                  + f" | {z3['step_s'] / free['step_s']:.3f} | {z3['slots']} | "
                  f"{z3['plan_ms']:.0f} |")
    big = load_model("llama-70b")
    lengths = sample_lengths("long", 256 * 65536, seed=0)
    try:
        one(big, lengths, 256, 3, "free", "dcp")
        free_70b = "plans"
    except PlanError as err:
        free_70b = f"PlanError: {str(err)[:120]}..."
    z3 = one(big, lengths, 256, 3, "lockstep", "dcp")
    rows["llama-70b/256/long"] = {"free": free_70b, "lockstep ZeRO-3": z3}
    print(f"\nllama-70b, 256 H200, long, ZeRO-3: free -> {free_70b}")
    print(f"lockstep -> step {z3['step_s']:.1f} s, {z3['tokens_per_s']:.0f} tokens/s, "
          f"efficiency {z3['efficiency']:.2f}, {z3['slots']} slots, {z3['tasks']} tasks, "
          f"static {z3['static_gib']:.1f} GiB, largest task {z3['peak_task_gib']:.1f} GiB of "
          f"{z3['budget_gib']:.1f} GiB, planned in {z3['plan_ms']:.0f} ms ({z3['candidate']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
