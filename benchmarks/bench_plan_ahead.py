#!/usr/bin/env python
"""How long a step waits for its plan when plans are made ahead (issue 21).

    python benchmarks/bench_plan_ahead.py [--gpus 32 1024] [--steps 4]

The step loop of `megatron_dcp.runtime.step.StepDriver` without the model: every step takes its
plan (made ahead on the background thread while the previous step ran; the first step plans in
place), starts planning the next batch (`StepDriver.plan_ahead`), then "runs" by sleeping for
the predicted step time of its plan (`StepDriver.predicted_step_s`: a sleep holds no GIL, as a
GPU step mostly waits on the device). llama-7b, h200 preset, ZeRO-1, balanced batches of
65,536 tokens per GPU (seeds 0..steps-1). Reported per world: the planning time (in place, and
on the thread), the predicted step time and the time each step waited for its plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.plan.presets import MODEL_PRESETS  # noqa: E402
from megatron_dcp.plan.workload import sample_lengths  # noqa: E402
from megatron_dcp.runtime.step import StepDriver  # noqa: E402


def run(world: int, steps: int) -> dict:
    """The step loop at ``world`` ranks; returns per-step rows."""
    pool = SimpleNamespace(rank=0, world_size=world, job_group=None)
    driver = StepDriver(DCPConfig(enabled=True, hardware="h200"), pool=pool, zero_stage=1,
                        model_shape=MODEL_PRESETS["llama-7b"])
    batches = [sample_lengths("balanced", 65536 * world, seed=s) for s in range(steps)]
    rows = []
    for i, lengths in enumerate(batches):
        plan, plan_s, wait_s = driver.timed_plan(lengths)
        if i + 1 < steps:
            driver.plan_ahead(batches[i + 1], iteration=i + 1)
        step_s = driver.predicted_step_s(plan)
        time.sleep(step_s)  # the step runs; the next plan is made meanwhile
        driver.iteration += 1
        rows.append({"step": i + 1, "sequences": len(lengths), "ahead": "made_ahead" in plan.meta,
                     "plan_ms": plan_s * 1e3, "wait_ms": wait_s * 1e3, "step_s": step_s})
    driver.close()
    return {"world": world, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[32, 1024])
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    print("| GPUs | step | sequences | plan | plan ms | predicted step s | wait ms |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    worst = {}
    for world in args.gpus:
        out = run(world, args.steps)
        for r in out["rows"]:
            where = "ahead" if r["ahead"] else "in place"
            print(f"| {world} | {r['step']} | {r['sequences']} | {where} | {r['plan_ms']:.0f} | "
                  f"{r['step_s']:.2f} | {r['wait_ms']:.2f} |", flush=True)
        worst[world] = max((r["wait_ms"] for r in out["rows"] if r["ahead"]), default=0.0)
    for world, ms in worst.items():
        print(f"{world} GPUs: longest wait for a plan made ahead {ms:.2f} ms (target <= 5 ms)")


if __name__ == "__main__":
    main()
