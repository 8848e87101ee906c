"""The benchmarks still run: every one parses its flags (``--help``: its imports and argument
parser), and the single-process ones run at their smallest settings and print their tables.
The multi-process training benchmarks (DeepSpeed, Megatron, HF, video, calibration) take
30-60 s each even at their smallest, so they are checked only through ``--help`` here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test runs a script

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))


def _run(script: str, *args: str, timeout: float = 120) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{script} {' '.join(args)}:\n{out.stdout[-2000:]}\n" \
                                f"{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", BENCHMARKS)
def test_parses_its_flags(script):
    assert "usage:" in _run(script, "--help")


@pytest.mark.timeout(120)
def test_long_sequence_smallest():
    # logits of 1,024 x 2,048 fp32 (8 MiB): a peak that RSS growth always sees (at 256 x 256
    # the allocator's free pages could hold a case's whole peak: growth 0, a flaky failure)
    out = _run("bench_long_sequence.py", "--tokens", "1024", "--hidden", "32", "--ffn", "64",
               "--vocab", "2048", "--heads", "2", "--layers", "2", "--repeat", "1")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["case"] for r in rows] == ["recompute", "mlp_tiles", "loss_tiles", "offload", "all"]
    assert all(r["peak_bytes"] > 0 and r["predicted_bytes"] > 0 for r in rows)
    assert rows[-1]["offload_copied_bytes"] == 2 * 2 * 1024 * 32 * 4  # both ways, fp32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script,args,expect", [
    ("bench_loss_memory.py", ("--vocab", "1024", "--tokens", "64", "--hidden", "16"),
     "| chunked | 1024 | 64 |"),
    ("bench_checkpoint_checksum.py", ("--gib", "0.001", "--repeats", "1"), "crc32 in memory"),
    ("bench_attention.py", ("--world", "2", "--lengths", "64", "--repeats", "1"), "ring 2"),
    ("bench_plan_ahead.py", ("--gpus", "32", "--steps", "1"), "32 GPUs: longest wait"),
])
def test_runs_at_its_smallest(script, args, expect):
    assert expect in _run(script, *args)
