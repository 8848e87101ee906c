"""What the DeepSpeed benchmarks share: launching a script as a DeepSpeed job (a benchmark's own
``--worker`` side, or an example), the flags of a benchmark that launches itself, writing and
reading back the JSON its rank 0 wrote, timing several modes on the same batches, writing the
report, and the global batches of the embedded corpus.

A benchmark script imports it as ``deepspeed_job`` (its own directory, ``benchmarks/``, is first
on ``sys.path`` both when run directly and inside the job the launcher starts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dcp.runtime.ports import free_port  # noqa: E402


def launch(ranks: int, script: str, script_args: Sequence[str], what: str, *,
           env: Optional[Mapping[str, str]] = None,
           timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """Run ``script SCRIPT_ARGS`` as a DeepSpeed job of ``ranks`` processes: the DeepSpeed
    launcher, from the repository root, ``OMP_NUM_THREADS=1`` and the repository on
    ``PYTHONPATH``, plus ``env``; its output is captured. A failed job raises `RuntimeError`
    starting with ``what`` and holding the end of the job's output."""
    job_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
           "--master_port", str(free_port()), script, *script_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_job(script: str, ranks: int, worker_args: Sequence[str], out: str, what: str) -> dict:
    """Run ``script --worker WORKER_ARGS`` as a DeepSpeed job of ``ranks`` processes (`launch`)
    and return the JSON that rank 0 wrote to ``out``. A failed job raises `RuntimeError`
    starting with ``what`` and holding the end of the job's output."""
    launch(ranks, script, ["--worker", *worker_args], what)
    with open(out) as f:
        return json.load(f)


def job_argument_parser(description: str) -> argparse.ArgumentParser:
    """The parser of a benchmark that launches itself with `run_job`: ``description`` shown as
    written, ``--local_rank`` (passed by the launcher) and the hidden ``--worker`` (the job's
    side)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def write_report(report: dict, args: argparse.Namespace, shown: Sequence[str],
                 **extra: Any) -> None:
    """The job's ``report`` with the benchmark's flags (``args`` but ``--worker`` and
    ``--local_rank``) under ``"args"`` and then ``extra``, written to ``args.out``; the keys
    ``shown`` printed as JSON, then where the report was written."""
    report["args"] = {k: v for k, v in vars(args).items() if k not in ("worker", "local_rank")}
    report.update(extra)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in shown}, indent=1))
    print(f"wrote {args.out}")


def write_rank0_json(work: Callable[[], Any], out: str) -> None:
    """Inside the job: ``work()``, whose result rank 0 writes to ``out`` as JSON; the process
    group is destroyed at the end, also when ``work`` raises."""
    import torch.distributed as dist

    try:
        result = work()
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()


def alternate_modes(train_steps: Mapping[str, Callable[[Any], Any]],
                    batches: Iterable[tuple[Any, dict]], warmup: int,
                    plan_fields: Callable[[Any], dict]) -> dict:
    """Every batch through every mode's ``train_steps[mode](batch)`` in turn, the order of the
    modes alternating between iterations (so machine load hits them alike), each step timed
    between two barriers. ``batches`` yields ``(batch, record)``: the record (its ``"tokens"``
    and whatever else describes the batch) gets each mode's seconds under the mode's name and,
    for the plan of a mode other than ``dp``, ``plan_fields(plan)`` as ``<mode>_<field>``.
    Iterations after the first ``warmup`` count. Returns ``tokens_per_s``, ``seconds``,
    ``losses`` (every iteration's, per mode), ``max_rel_loss_diff`` (against the first mode)
    and ``iterations`` (the records that count)."""
    import torch.distributed as dist

    modes = list(train_steps)
    tokens, seconds = dict.fromkeys(modes, 0), dict.fromkeys(modes, 0.0)
    losses: dict[str, list[float]] = {m: [] for m in modes}
    records = []
    for it, (batch, record) in enumerate(batches):
        for m in modes if it % 2 == 0 else modes[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            result = train_steps[m](batch)
            dist.barrier()
            record[m] = round(time.perf_counter() - t0, 4)
            if result.plan is not None and m != "dp":
                record.update({f"{m}_{k}": v for k, v in plan_fields(result.plan).items()})
            if it >= warmup:
                tokens[m] += record["tokens"]
                seconds[m] += record[m]
            losses[m].append(result.loss)
        if it >= warmup:
            records.append(record)
    diffs = [abs(a - b) / abs(b) for m in modes for a, b in zip(losses[m], losses[modes[0]])]
    return {"tokens_per_s": {m: tokens[m] / seconds[m] for m in modes}, "seconds": seconds,
            "losses": losses, "max_rel_loss_diff": max(diffs), "iterations": records}


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
