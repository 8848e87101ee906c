#!/usr/bin/env python
"""What the per-step figures cost the rank that writes them, and how far a packed-sample FLOP
count is off (issue 44).

    python benchmarks/bench_figures.py [--gpus 64 256 1024] [--steps 20]

For each world: llama-7b, h200 preset, ZeRO-1, ``balanced`` batches of 65,536 tokens per GPU; the
plan of each step from `StepDriver.plan`, then `StepFigures` on it with the predicted step time
as the measured one (no model runs). Reported: the planning time, the figures' time at the
first step (the plan's lower bound included) and per step over ``--steps`` (the bound only in
the steps its budget allows, `EFFICIENCY_SHARE`), and the share of steps with
``plan_efficiency``. Then the same documents packed in order into samples of ``--seq-length``
tokens (cut at sample ends, as Megatron's GPT dataset does): the FLOPs a packed-sample count
(attention over each whole sample, Megatron-LM's throughput line) gives over the per-document
count (`document_flops`).
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
from megatron_dcp.runtime.figures import StepFigures, document_flops  # noqa: E402
from megatron_dcp.runtime.step import StepDriver  # noqa: E402


def packed_pieces(lengths: list[int], seq_length: int) -> tuple[list[int], int]:
    """The documents cut where samples of ``seq_length`` end, and the number of samples."""
    pieces, room = [], seq_length
    for n in lengths:
        while n > 0:
            take = min(n, room)
            pieces.append(take)
            n, room = n - take, room - take
            room = room or seq_length
    samples = -(-sum(lengths) // seq_length)
    return pieces, samples


def run(world: int, steps: int, dist: str, seq_length: int) -> dict:
    """One world's row (see the module doc)."""
    shape = MODEL_PRESETS["llama-7b"]
    pool = SimpleNamespace(rank=0, world_size=world, job_group=None)
    driver = StepDriver(DCPConfig(enabled=True, hardware="h200"), pool=pool, zero_stage=1,
                        model_shape=shape)
    figures = StepFigures(driver)
    plan_s, figure_s, with_bound, first_s = 0.0, [], 0, 0.0
    lengths = []
    for step in range(steps):
        lengths = sample_lengths(dist, 65536 * world, seed=step)
        t0 = time.perf_counter()
        plan = driver.plan(lengths)
        t1 = time.perf_counter()
        predicted = driver.predicted_step_s(plan)
        result = SimpleNamespace(plan=plan, loss=1.0, grad_norm=None, wall_s=predicted,
                                 skipped=False, predicted_s=predicted, calibration_error=None,
                                 plan_s=t1 - t0, plan_wait_s=0.0)
        fig = figures(result)
        t2 = time.perf_counter()
        plan_s += t1 - t0
        figure_s.append(t2 - t1)
        with_bound += "plan_efficiency" in fig
        first_s = first_s or (t2 - t1)
    pieces, samples = packed_pieces(lengths, seq_length)
    packed = document_flops(shape, [seq_length] * samples)
    return {"world": world, "sequences": len(lengths), "plan_ms": 1e3 * plan_s / steps,
            "first_ms": 1e3 * first_s, "figures_ms": 1e3 * sum(figure_s) / steps,
            "step_s": predicted, "with_bound": with_bound / steps,
            "packed_over": packed / document_flops(shape, pieces) - 1.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dist", default="balanced", help="length distribution (dcp-simulate's --dist)")
    p.add_argument("--seq-length", type=int, default=8192, help="packed sample length")
    args = p.parse_args(argv)
    print("| GPUs | sequences | plan ms | figures ms, first step | figures ms per step | step s "
          "| steps with plan_efficiency | packed-sample FLOPs over per-document |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for world in args.gpus:
        r = run(world, args.steps, args.dist, args.seq_length)
        print(f"| {r['world']} | {r['sequences']} | {r['plan_ms']:.0f} | {r['first_ms']:.0f} | "
              f"{r['figures_ms']:.1f} | {r['step_s']:.2f} | {100 * r['with_bound']:.0f} % | "
              f"+{100 * r['packed_over']:.1f} % |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
