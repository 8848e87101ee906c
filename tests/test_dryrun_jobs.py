"""The dry run as a Megatron team runs it (issue 60 item 3): a flushed line per finished rank
with a running summary (so ``dcp-dry-run ... > log`` shows progress), ranks in ``--jobs N``
worker processes with the report of ``--jobs 1`` (a dead worker named with its rank, nothing
waiting on it), and ``--worst-case``: a batch whose plan puts every rank's task at the budget.
A tiny model (64 wide, one layer) on 4 ranks: seconds a rank."""

from __future__ import annotations

import io
import json
import sys

import pytest

from megatron_dcp.dryrun import workers
from megatron_dcp.dryrun.__main__ import main, parse_args, run
from megatron_dcp.dryrun.worst_case import worst_case


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"num_layers": 1, "hidden_size": 64, "num_heads": 4,
                                "ffn_hidden_size": 128, "vocab_size": 256, "name": "tiny"}))
    return ["--gpus", "4", "--layers", "1", "--model", str(path)]


def _without_seconds(report: dict) -> dict:
    for row in report["ranks"]:
        row.pop("seconds")
    return report


@pytest.mark.slow  # worker processes
@pytest.mark.timeout(600)
def test_jobs_two_gives_the_report_of_jobs_one(tiny, tmp_path, capsys):
    """The same JSON (less each rank's seconds) from two worker processes as from one rank
    after another, and a line for every rank either way."""
    out = {}
    for jobs in ("1", "2"):
        path = tmp_path / f"jobs{jobs}.json"
        assert main([*tiny, "--global-batch-tokens", "32768", "--jobs", jobs,
                     "--json", str(path)]) == 0
        printed = capsys.readouterr().out
        assert ("2 worker processes" if jobs == "2" else "one rank at a time") in printed
        for rank in range(4):
            assert f"rank {rank} done (" in printed, printed
        assert "4 of 4 in " in printed and "0 failed, 0 over budget" in printed
        out[jobs] = _without_seconds(json.loads(path.read_text()))
    assert out["1"] == out["2"]
    assert out["1"]["ok"] and len(out["1"]["ranks"]) == 4


@pytest.mark.slow  # worker processes
@pytest.mark.timeout(600)
def test_a_worker_that_dies_is_named_with_its_rank_and_the_others_run(tiny, capsys):
    report = run(parse_args([*tiny, "--global-batch-tokens", "32768", "--jobs", "2"]),
                 worker_exit_at=2)
    assert not report["ok"]
    rows = {r["rank"]: r for r in report["ranks"]}
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[2]["error"].startswith("rank 2: its worker process (pid ")
    assert "exited with status 3 while running it" in rows[2]["error"]
    assert all(rows[r]["error"] == "" and rows[r]["collectives"] for r in (0, 1, 3))
    assert "rank 2 FAILED (" in capsys.readouterr().out


def test_a_rank_line_reaches_the_log_before_the_next_rank_runs(tiny, monkeypatch):
    """``dcp-dry-run ... > log``: stdout is a block-buffered file; rank 0's line (with the
    running summary) is in it, flushed, while rank 1 runs."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, write_through=False))
    seen = {}
    real = workers.rank_function("runtime")

    def spy(job, rank):
        seen[rank] = raw.getvalue().decode()
        return real(job, rank)

    monkeypatch.setattr(workers, "rank_function", lambda engine: spy)
    run(parse_args([*tiny, "--global-batch-tokens", "16384", "--ranks", "0,1"]))
    assert "one rank at a time; a line per rank as it finishes" in seen[0]
    assert "rank 0 done (1 of 2): " in seen[1] and "1 of 2 in " in seen[1], seen[1]
    assert "activations " in seen[1] and " predicted (" in seen[1] and "of the budget's" in seen[1]


def test_a_rank_that_raises_is_its_row_not_the_end_of_the_run(tiny, monkeypatch):
    real = workers.rank_function("runtime")

    def flaky(job, rank):
        if rank == 1:
            raise RuntimeError("a broken rank")
        return real(job, rank)

    monkeypatch.setattr(workers, "rank_function", lambda engine: flaky)
    report = run(parse_args([*tiny, "--global-batch-tokens", "16384", "--ranks", "0,1,2"]))
    rows = {r["rank"]: r for r in report["ranks"]}
    assert rows[1]["error"] == "rank 1: RuntimeError: a broken rank" and not report["ok"]
    assert rows[0]["error"] == rows[2]["error"] == "" and report["consistent"]


def test_worst_case_puts_every_rank_at_the_memory_budget(tiny, capsys):
    """8 GiB a rank: a rank's capacity is 659,900 tokens, cut into 11 equal sequences of at
    most --max-len; the plan gives every rank one task of them all, predicted at the budget
    (a short remainder sequence, as first built, was packed on its own: 99.35 %)."""
    report = run(parse_args([*tiny, "--worst-case", "--memory-budget-gb", "8",
                             "--max-len", "65536"]))
    worst = report["worst_case"]
    assert worst["bound"] == "memory budget" and worst["ranks_at_capacity"] == 4
    assert report["tokens"] == 4 * worst["capacity_tokens"]
    for row in report["ranks"]:
        assert row["error"] == ""
        assert 0.999 < row["predicted_bytes"] / row["budget_bytes"] <= 1.0, row
    assert "the plan gives 4 of 4 DCP ranks a task of that many" in capsys.readouterr().out


def test_worst_case_at_the_token_budget():
    """--max-tokens-per-rank (the token budget) below what memory allows: every rank's task
    holds exactly that many tokens."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import load_model

    import dataclasses

    shape = dataclasses.replace(load_model("llama-7b"), num_layers=2)
    config = DCPConfig(enabled=True, calibration="off", max_tokens_per_rank=8192)
    worst = worst_case(shape, config, 8, hardware="h200", zero_stage=0,
                       offload_optimizer=False, max_len=3000)
    assert worst.capacity == 8192 and worst.bound == "--max-tokens-per-rank"
    assert max(worst.lengths) <= 3000 and sum(worst.lengths) == 8 * 8192
    assert worst.at_capacity == 8


@pytest.mark.parametrize("flags, message", [
    (["--worst-case", "--corpus"], "--worst-case builds its own batch (every rank's task at the "
                                   "budget): leave out --corpus"),
    (["--jobs", "0"], "argument --jobs: "),
])
def test_flags_are_refused_at_parse_time(flags, message, tiny, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*tiny, *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.megatron  # --engine megatron: the megatron-core 0.19 leg runs it too
def test_a_rank_measures_the_same_first_in_a_process_or_after_others(tiny):
    """Two TP peers (the same work) one after the other in this process: the same memory to the
    byte. The flash backward's per-device constants (16 bytes, cached at a process's first
    backward) were counted only by the first rank a process ran, so ``--jobs 2`` differed
    from ``--jobs 1`` on the Megatron path."""
    report = run(parse_args([*tiny, "--engine", "megatron", "--gpus", "8", "--tp", "2",
                             "--pp", "2", "--layers", "2", "--sequence-parallel", "--ranks",
                             "0,1", "--worst-case", "--memory-budget-gb", "8"]))
    first, second = report["ranks"]
    assert first["error"] == second["error"] == ""
    assert first["peak_by_kind"] == second["peak_by_kind"]


def _children(pid: int) -> list[int]:
    import os

    out = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if name.isdigit() and int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(name))
    return out


@pytest.mark.slow  # a dry run in a subprocess, with worker processes
@pytest.mark.timeout(300)
def test_a_terminated_run_leaves_no_worker_behind(tiny):
    """A scheduler's SIGTERM to ``dcp-dry-run --jobs 2``: the run stops (status 143) and its
    workers with it; they ran on, orphaned, for a rank each (minutes at real depth)."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "megatron_dcp.dryrun", *tiny, "--gpus", "16",
                             "--global-batch-tokens", "65536", "--jobs", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while len(_children(proc.pid)) < 3 and time.time() < deadline:  # 2 workers, 1 tracker
        time.sleep(0.1)
    workers_ = _children(proc.pid)
    assert len(workers_) >= 3, "no workers started"
    proc.send_signal(signal.SIGTERM)
    status = proc.wait(timeout=60)
    time.sleep(2)
    left = [pid for pid in workers_ if os.path.exists(f"/proc/{pid}")
            and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    for pid in left:  # the test's own cleanup, then the verdict
        os.kill(pid, signal.SIGKILL)
    assert left == [] and status == 143
