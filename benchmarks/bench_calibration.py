"""Zero-configuration planning: `examples/pretrain.py --dcp` without a profile vs without --dcp.

Runs the README's DeepSpeed command (`deepspeed --num_gpus 2 examples/pretrain.py --train-iters
8 --seed 7`, defaults otherwise) once per mode and repeat, alternating the order of the modes
between repeats (the machine is shared: every ratio comes from runs next to each other):

* ``dp``: without ``--dcp`` (plain DeepSpeed data parallel);
* ``auto``: ``--dcp`` with no ``--dcp_hardware`` (auto: a CPU start, calibrated online);
* ``wrong``: ``--dcp --dcp_hardware runs/hardware_10x.json``, a profile with every rate 10x too
  high (and the fixed costs 10x too low), calibrated online;
* ``off``: ``--dcp --dcp_calibration off`` (the auto start, never corrected).

Reported per mode: tokens/s over iterations 3-8, its ratio to ``dp`` of the same repeat, and the
median |predicted_s / step_s - 1| over iterations 4-8 (from the ``--log-json`` rows). Writes
``--out`` (JSON with every row) and prints a markdown table.

    OMP_NUM_THREADS=1 python benchmarks/bench_calibration.py --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from deepspeed_job import ROOT, launch

sys.path.insert(0, str(ROOT))

MODES = ("dp", "auto", "wrong", "off")


def wrong_profile(path: Path) -> str:
    """A profile of this CPU's auto start with every rate 10x too high, fixed costs 10x too low."""
    from megatron_dcp.runtime.hardware_auto import cpu_start

    hw = cpu_start(2)
    fast = replace(hw, name="cpu-10x-too-fast", linear_flops=hw.linear_flops * 10,
                   peak_flops=hw.peak_flops * 10, attention_flops=hw.attention_flops * 10,
                   ring_attention_flops=hw.ring_attention_flops * 10,
                   hybrid_attention_flops=hw.hybrid_attention_flops * 10,
                   hbm_bandwidth=hw.hbm_bandwidth * 10, intra_bandwidth=hw.intra_bandwidth * 10,
                   inter_bandwidth=hw.inter_bandwidth * 10, intra_latency=hw.intra_latency / 10,
                   inter_latency=hw.inter_latency / 10, token_overhead_s=hw.token_overhead_s / 10,
                   task_overhead_s=hw.task_overhead_s / 10)
    path.write_text(json.dumps(fast.to_dict(), indent=1))
    return str(path)


def run(mode: str, args, log: Path, profile: str) -> list[dict]:
    """One training run of ``mode``; returns its --log-json rows."""
    extra = {"dp": [], "auto": ["--dcp"], "wrong": ["--dcp", "--dcp_hardware", profile],
             "off": ["--dcp", "--dcp_calibration", "off"]}[mode]
    launch(2, "examples/pretrain.py", ["--train-iters", str(args.iters), "--seed",
                                       str(args.seed), "--log-json", str(log), "--overwrite-log",
                                       "--quiet", *extra],
           f"the {mode} run")
    return [json.loads(line) for line in log.read_text().splitlines()]


def summarise(rows: list[dict]) -> dict:
    """Tokens/s over iterations 3-8 and the median prediction error over iterations 4-8."""
    timed = [r for r in rows if 3 <= r["iteration"] <= 8]
    errors = sorted(abs(r["predicted_s"] / r["step_s"] - 1) for r in rows
                    if 4 <= r["iteration"] <= 8 and r.get("predicted_s"))
    median = (errors[(len(errors) - 1) // 2] + errors[len(errors) // 2]) / 2 if errors else None
    return {"tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed),
            "median_error": median}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default="runs/bench_calibration.json")
    args = p.parse_args()
    modes = args.modes.split(",")
    runs = ROOT / "runs"
    runs.mkdir(exist_ok=True)
    profile = wrong_profile(runs / "hardware_10x.json")
    results = []
    for rep in range(args.repeats):
        order = modes if rep % 2 == 0 else modes[::-1]
        row = {"repeat": rep, "order": order, "load_before": os.getloadavg()[0]}
        for mode in order:
            rows = run(mode, args, runs / f"bench_calibration_{mode}.jsonl", profile)
            row[mode] = {**summarise(rows), "rows": rows}
            print(f"repeat {rep} {mode}: {row[mode]['tokens_per_s']:.0f} tokens/s, median "
                  f"error {row[mode]['median_error']}", flush=True)
        row["load_after"] = os.getloadavg()[0]
        results.append(row)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n| repeat (load) | " + " | ".join(f"{m} tok/s" for m in modes)
          + " | " + " | ".join(f"{m} / dp" for m in modes if m != "dp")
          + " | " + " | ".join(f"{m} median error" for m in modes if m != "dp") + " |")
    print("|" + " --- |" * (1 + len(modes) + 2 * (len(modes) - 1)))
    for row in results:
        dp = row["dp"]["tokens_per_s"] if "dp" in row else None
        cells = [f"{row[m]['tokens_per_s']:.0f}" for m in modes]
        cells += [f"{row[m]['tokens_per_s'] / dp:.2f}x" if dp else "-" for m in modes if m != "dp"]
        cells += [f"{row[m]['median_error'] * 100:.1f} %" if row[m]["median_error"] is not None
                  else "-" for m in modes if m != "dp"]
        print(f"| {row['repeat']} ({row['load_before']:.1f}-{row['load_after']:.1f}) | "
              + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
