"""Peak memory per rank under ZeRO-3: ``--dcp`` (lockstep: sharding kept) vs plain DeepSpeed,
with a model whose parameters dominate memory, and ``--dcp`` on a free schedule (parameters kept
gathered: what ``--dcp`` did before lockstep schedules) for contrast.

  python benchmarks/bench_zero_memory.py                 # 4 ranks, writes runs/zero_memory.json

One ``deepspeed`` launch of examples/pretrain.py per mode (peak memory is per process, so modes
cannot share a job), the same global batches in each. Model: the reference decoder with hidden
768 and 8 layers (57M parameters: 0.23 GB of fp32 weights, 0.23 GB of gradients, 0.46 GB of
Adam states unsharded; a quarter of each per rank at 4 ranks), fp32, sequences up to 256 tokens
in global batches of 2048 tokens, and DCP's pack budget at 256 tokens, so that a micro-step's
activations (about 0.37 MB per token) stay below the parameters and optimizer states in both
modes. ZeRO-3 with its own defaults. Each row is rank 0's ``peak_mem_mb``: its peak from the
start of training to the end of the last iteration (peak RSS on CPU, CUDA max allocated on
GPUs; the examples reset it after start-up, where the model is built whole before ZeRO-3
partitions it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from deepspeed_job import ROOT, launch

PACK = ["--dcp_pack_tokens", "256"]
MODES = {"plain ZeRO-3": [], "--dcp (lockstep)": ["--dcp", *PACK],
         "--dcp free (parameters gathered)": ["--dcp", *PACK, "--dcp_schedule", "free"]}


def run(mode_flags: list[str], args) -> dict:
    """One launch; rank 0's last log row."""
    log = tempfile.mktemp(suffix=".jsonl")
    flags = ["--zero-stage", "3", "--hidden-size", str(args.hidden), "--num-layers",
             str(args.layers), "--num-heads", "8", "--seq-length", "256",
             "--global-batch-tokens", "2048", "--train-iters", str(args.iters), "--seed", "5",
             "--quiet", "--log-json", log, *mode_flags]
    # glibc's malloc keeps freed blocks up to 32 MB in its heap (its mmap threshold grows as
    # large blocks are freed), so the RSS would count memory ZeRO-3 released long ago; a fixed
    # threshold returns every large tensor to the system when it is freed
    launch(args.ranks, "examples/pretrain.py", flags,
           f"examples/pretrain.py {' '.join(mode_flags)}",
           env={"MALLOC_MMAP_THRESHOLD_": "131072"}, timeout=3000)
    with open(log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"peak_mem_mb": rows[-1]["peak_mem_mb"], "losses": [r["loss"] for r in rows],
            "step_s": [r["step_s"] for r in rows], "plan": rows[-1]["plan"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "runs" / "zero_memory.json"))
    args = p.parse_args(argv)
    results = {name: run(flags, args) for name, flags in MODES.items()}
    base = results["plain ZeRO-3"]["peak_mem_mb"]
    print(f"| mode ({args.ranks} ranks, ZeRO-3) | peak memory rank 0, MB | vs plain | losses |")
    print("| --- | --- | --- | --- |")
    for name, r in results.items():
        losses = ", ".join(f"{x:.5f}" for x in r["losses"])
        print(f"| {name} | {r['peak_mem_mb']:.0f} | {r['peak_mem_mb'] / base:.3f} | {losses} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
