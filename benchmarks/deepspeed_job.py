"""What the DeepSpeed benchmarks share: launching a benchmark script as a DeepSpeed job and
reading back the JSON its rank 0 wrote, and the global batches of the embedded corpus.

A benchmark script imports it as ``deepspeed_job`` (its own directory, ``benchmarks/``, is first
on ``sys.path`` both when run directly and inside the job the launcher starts).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on this host now (for the job's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(script: str, ranks: int, worker_args: Sequence[str], out: str, what: str) -> dict:
    """Run ``script --worker WORKER_ARGS`` as a DeepSpeed job of ``ranks`` processes (the
    DeepSpeed launcher, from the repository root, ``OMP_NUM_THREADS=1``) and return the JSON
    that rank 0 wrote to ``out``. A failed job raises `RuntimeError` starting with ``what``
    and holding the end of the job's output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
           "--master_port", str(free_port()), script, "--worker", *worker_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def embedded_batches(global_batch_tokens: int, seq_length: int, seed: int,
                     count: int) -> Iterator[list]:
    """``count`` global batches of the embedded corpus (byte tokens, long-tailed lengths) as
    lists of int64 token tensors, each sequence cut to ``seq_length``; the same on every rank
    for the same seed."""
    import torch

    from megatron_dcp.data import GlobalBatchSampler, embedded_dataset

    data = embedded_dataset()
    sampler = GlobalBatchSampler(data.lengths, global_batch_tokens, seed=seed,
                                 max_seq_len=seq_length)
    for _ in range(count):
        docs = sampler.next_batch()
        yield [torch.from_numpy(data[d][:seq_length].astype("int64")) for d in docs]
