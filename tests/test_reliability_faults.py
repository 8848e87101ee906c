"""A stalled rank ends the job: DeepSpeed's own process groups get the job's timeout, and the
other ranks name the rank that stopped answering.

The fault test stops one rank of a real ``deepspeed``-launched ``examples/pretrain.py`` job with
SIGSTOP (what a hung device looks like from outside) under a short process-group timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest

from distributed import JOB_ENV, deepspeed_command

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 10
LAUNCHER_GRACE_S = 30
"""DeepSpeed's launcher sends SIGTERM to the ranks left when one fails and waits 30 s before
SIGKILL (``launch.py: terminate_process_tree``); a stopped process only dies by SIGKILL."""


def test_deepspeed_groups_get_the_timeout(monkeypatch):
    """Every group DeepSpeed creates (``TorchBackend.new_group``) is given the timeout."""
    import torch.distributed
    from deepspeed.comm.torch import TorchBackend

    from deepspeed_plugin import patches

    calls = []
    monkeypatch.setattr(torch.distributed, "new_group",
                        lambda ranks, **kwargs: calls.append((list(ranks), kwargs)) or "group")
    original = TorchBackend.new_group
    patches.process_group_timeout(timedelta(seconds=7))
    try:
        assert "process_group_timeout" in patches.applied()
        assert TorchBackend.new_group(None, [0, 1]) == "group"
        patches.process_group_timeout(timedelta(seconds=9))  # a second call replaces it
        TorchBackend.new_group(None, [1])
    finally:
        patches.undo("process_group_timeout")
    assert calls == [([0, 1], {"timeout": timedelta(seconds=7)}),
                     ([1], {"timeout": timedelta(seconds=9)})]
    assert TorchBackend.new_group is original


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """Pids of the training ranks under the launcher (``--local_rank=N`` in their command)."""
    import psutil

    found = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if any(part.endswith("pretrain.py") for part in cmd):
            for part in cmd:
                if part.startswith("--local_rank="):
                    found[int(part.split("=")[1])] = child.pid
    return found


def _stall_rank_1(tmp_path, flags: list[str], limit_s: float) -> tuple[str, float]:
    """Launch a 2-rank ``--dcp`` job, SIGSTOP rank 1 after two iterations; returns (output,
    seconds until rank 0 ended). The job is then killed: DeepSpeed's launcher would wait
    `LAUNCHER_GRACE_S` for the stopped rank before its SIGKILL."""
    import psutil

    log = tmp_path / "train.jsonl"
    cmd = deepspeed_command(
        2, "examples/pretrain.py", "--dcp", "--zero-stage", "1", "--train-iters", "100000",
        "--global-batch-tokens", "1024", "--seq-length", "256", "--num-layers", "1",
        "--hidden-size", "32", "--num-heads", "4", "--quiet", "--log-json", str(log), *flags)
    out = open(tmp_path / "out.txt", "w")
    job = subprocess.Popen(cmd, cwd=ROOT, env=JOB_ENV, stdout=out, stderr=subprocess.STDOUT,
                           start_new_session=True)
    stopped = None
    try:
        deadline = time.time() + 120
        while time.time() < deadline and job.poll() is None:
            if log.exists() and len(log.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        pids = _rank_pids(job.pid)
        assert sorted(pids) == [0, 1], (pids, (tmp_path / "out.txt").read_text()[-3000:])
        stopped = psutil.Process(pids[1])
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs mid-training
        t_stop = time.monotonic()
        survivor = psutil.Process(pids[0])
        survivor.wait(timeout=limit_s)
        t_survivor = time.monotonic() - t_stop
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        if stopped is not None and stopped.is_running():
            stopped.kill()
        out.close()
    return (tmp_path / "out.txt").read_text(), t_survivor


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stalled_rank_ends_the_job_naming_it(tmp_path):
    """The collective timeout's path (the watch off): the failed collective names the rank."""
    text, t_survivor = _stall_rank_1(
        tmp_path, ["--distributed-timeout-s", str(TIMEOUT_S), "--dcp_liveness_interval_s", "0"],
        TIMEOUT_S + 30)
    assert "rank(s) [1] did not answer a liveness probe" in text, text[-4000:]
    # the other rank ends within the timeout (the launcher then ends the job: rank 0 failed; it
    # waits LAUNCHER_GRACE_S for the stopped rank before SIGKILL, DeepSpeed's behaviour)
    assert t_survivor <= TIMEOUT_S + 30, t_survivor
    print(f"stalled rank 1: rank 0 exited after {t_survivor:.1f} s (timeout {TIMEOUT_S} s)")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stall_under_the_default_timeout_ends_the_job_within_two_intervals(tmp_path):
    """The default 30-minute timeout: the liveness watch ends the job, naming the rank."""
    text, t_survivor = _stall_rank_1(tmp_path, ["--dcp_liveness_interval_s", "2"], 60)
    assert "rank(s) [1] did not answer two liveness probes" in text, text[-4000:]
    assert t_survivor <= 30, t_survivor
    print(f"stalled rank 1 under a 30 min timeout: rank 0 exited after {t_survivor:.1f} s")
