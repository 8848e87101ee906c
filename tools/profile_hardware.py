#!/usr/bin/env python
"""Measure the cost model's coefficients on this machine and write a hardware profile JSON.

    python tools/profile_hardware.py --out runs/cpu-profile.json     # this CPU, 1 thread a rank
    python tools/profile_hardware.py --device cuda --out gpu.json    # GPUs (bf16 by default)
    python tools/simulate.py ... --hardware runs/cpu-profile.json    # plans use measured costs

What is measured and how it is fitted: `megatron_dcp.profiling.hardware`. On a terminal a
progress bar on stderr counts the measurements (GEMM, copy, model tasks, packed tasks,
communication); a log gets the lines of the measured points only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dcp.profiling import ProfileSettings, profile_hardware  # noqa: E402
from megatron_dcp.progress import Progress  # noqa: E402


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags (model size of the timing runs, grid, output)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/profile.json", help="profile JSON to write")
    p.add_argument("--name", default=None, help="hardware name in the profile")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--ranks", type=int, default=2, help="processes of the communication and "
                   "ring/hybrid task tests (and ranks per node in the profile); 0 skips them")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=None,
                   help="MLP width; default: the reference Decoder's for --hidden (688 at 256)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lengths", type=_ints, default=ProfileSettings.lengths,
                   help="comma-separated sequence lengths of the one-rank model timings")
    p.add_argument("--pack-sizes", type=_ints, default=ProfileSettings.pack_sizes,
                   help="comma-separated packed-task sizes (tokens) of the pack curve; '' skips it")
    p.add_argument("--pack-seq", type=int, default=256,
                   help="length of the short sequences packed into those tasks")
    p.add_argument("--layout-lengths", type=_ints, default=ProfileSettings.layout_lengths,
                   help="comma-separated sequence lengths of the ring and hybrid tasks")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--concurrent", action="store_true",
                   help="time the model in --ranks processes at once (what a job's ranks see "
                        "when they share a machine); default: one process alone")
    p.add_argument("--quick", action="store_true", help="tiny grid (tests, the demo)")
    return p


def _check_writable(path: str) -> None:
    """Fail before measuring, not after, when the profile cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        existed = os.path.exists(path)
        with open(path, "a"):
            pass
        if not existed:
            os.remove(path)
    except OSError as err:
        raise SystemExit(f"error: cannot write the profile to {path!r}: "
                         f"{err.strerror or err}") from None


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: measure, fit, write the JSON, print a summary."""
    args = build_parser().parse_args(argv)
    _check_writable(args.out)
    known = {f.name for f in fields(ProfileSettings)}
    settings = ProfileSettings(**{k: v for k, v in vars(args).items() if k in known})
    with Progress("profiling") as bar:  # on a terminal: the measurements done and running
        data = profile_hardware(settings, progress=bar)
    with open(args.out, "w") as handle:
        json.dump(data, handle, indent=1)
    m = data["measured"]
    rates = "/".join(f"{(data.get(k) or data['attention_flops']) / 1e9:.2f}"
                     for k in ("attention_flops", "ring_attention_flops",
                               "hybrid_attention_flops"))
    print(f"wrote {args.out}: linear {data['linear_flops'] / 1e9:.2f} GFLOP/s, attention "
          f"(local/ring/hybrid) {rates} GFLOP/s, token overhead "
          f"{data['token_overhead_s'] * 1e6:.2f} us, task overhead "
          f"{data['task_overhead_s'] * 1e3:.2f} ms, all-to-all {data['intra_bandwidth'] / 1e9:.2f}"
          f" GB/s + {data['intra_latency'] * 1e6:.0f} us; fit max error "
          f"{m['fit_max_rel_error'] * 100:.1f} % ({m['seconds']:.0f} s); pack budget "
          f"{str(data['pack_tokens']) + ' tokens' if data['pack_tokens'] else 'none'}, pack "
          f"curve {data['pack_curve']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
