"""The liveness watch: under a long collective timeout, a stalled rank still ends the job within
about two probe intervals, named on every live rank; healthy ranks are never named (a rank busy
in its main thread, a rank that ended on purpose, a step longer than the interval).

Each case is a real gloo job of 3 processes (`_RANK_SCRIPT`) whose collectives have a 300 s
timeout: only the watch can end a stalled job within the test's limits.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from distributed import JOB_ENV, ROOT, free_port

_RANK_SCRIPT = r"""
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from megatron_dcp.runtime import liveness

rank, world, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[4], rank=rank,
                        world_size=world, timeout=timedelta(seconds=300))
liveness.start_responder(interval_s=1.0)
dist.barrier()
print(f"rank {rank} ready", flush=True)
if case == "stop" and rank == 1:
    import signal
    os.kill(os.getpid(), signal.SIGSTOP)  # stalls here: the test kills it
if case == "busy" and rank == 1:
    time.sleep(6)  # main thread busy (a long, healthy step): the responder still answers
if case == "ends" and rank == 1:
    liveness.stop_responder(); dist.destroy_process_group(); sys.exit(0)
if case == "ends":
    time.sleep(6)  # rank 1 ended on purpose: not a stall
else:
    dist.all_reduce(torch.ones(1))
if case == "host-ends-first" and rank != 0:
    time.sleep(3)  # rank 0, the store's host, has exited: ending must not wait for it
if case == "quiet-end":
    from megatron_dcp.runtime.groups import destroy_process_groups
    if rank:
        time.sleep(2.5)  # a later rank's responder would look into the store of an ended host
    destroy_process_groups()
    print(f"rank {rank} done", flush=True)
    sys.exit(0)
liveness.stop_responder()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
"""


def _launch(case: str, tmp_path, world: int = 3):
    port = str(free_port())
    procs = []
    for rank in range(world):
        out = open(tmp_path / f"rank{rank}.txt", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(rank), str(world), case, port],
            cwd=ROOT, env=JOB_ENV, stdout=out, stderr=subprocess.STDOUT))
    return procs


def _wait_ready(tmp_path, world: int, limit_s: float = 60) -> None:
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if all("ready" in (tmp_path / f"rank{r}.txt").read_text() for r in range(world)):
            return
        time.sleep(0.1)
    raise AssertionError("ranks did not start: " + "\n".join(
        (tmp_path / f"rank{r}.txt").read_text()[-2000:] for r in range(world)))


def _kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stalled_rank_ends_the_job_within_two_intervals(tmp_path):
    procs = _launch("stop", tmp_path)
    try:
        _wait_ready(tmp_path, 3)
        t0 = time.monotonic()
        for rank in (0, 2):
            procs[rank].wait(timeout=150)  # generous: a loaded CI machine starts slowly
        elapsed = time.monotonic() - t0
    finally:
        _kill_all(procs)
    from megatron_dcp.runtime.liveness import STALL_EXIT_CODE

    for rank in (0, 2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert procs[rank].returncode == STALL_EXIT_CODE, text[-3000:]
        assert "rank(s) [1] did not answer two liveness probes" in text, text[-3000:]
    # two probes 1 s apart, a 3 s wait each, a poll (seconds; more on a loaded machine): far
    # below the 300 s collective timeout
    assert elapsed < 120, elapsed


def _run_to_end(case: str, tmp_path) -> list[str]:
    """Each rank's output of a job of ``case`` that every rank ended with status 0."""
    procs = _launch(case, tmp_path)
    try:
        for p in procs:
            p.wait(timeout=90)
    finally:
        _kill_all(procs)
    texts = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(len(procs))]
    for p, text in zip(procs, texts):
        assert p.returncode == 0, text[-3000:]
    return texts


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["busy", "ends", "host-ends-first"])
def test_healthy_ranks_are_not_named(tmp_path, case):
    for text in _run_to_end(case, tmp_path):
        assert "liveness probes" not in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ending_the_job_prints_no_store_error(tmp_path):
    """`destroy_process_groups` stops the responders, and rank 0 (the store's host) waits for
    every rank's: no responder looks into the store after its host exited (torch would print a
    C++ trace, "recvValue failed", on a job that ended well)."""
    for rank, text in enumerate(_run_to_end("quiet-end", tmp_path)):
        assert f"rank {rank} done" in text, text[-3000:]
        assert "TCPStore" not in text and "recvValue" not in text, text[-3000:]


def test_interval_is_a_setting():
    from megatron_dcp.config import DCPConfig, DCPConfigError

    assert DCPConfig().liveness_interval_s == 60.0
    assert DCPConfig(liveness_interval_s=0).liveness_interval_s == 0
    with pytest.raises(DCPConfigError, match="liveness_interval_s"):
        DCPConfig(liveness_interval_s=-1.0)


def test_no_default_timeout_under_30_minutes():
    """A long, healthy step must never reach a default collective timeout."""
    import deepspeed_plugin
    from megatron_dcp.runtime import groups

    assert groups.DEFAULT_GROUP_TIMEOUT.total_seconds() >= 1800
    assert deepspeed_plugin.PROCESS_GROUP_TIMEOUT.total_seconds() >= 1800
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import pretrain
        import pretrain_megatron

        assert pretrain.parse_args([]).distributed_timeout_s >= 1800
        assert pretrain_megatron.parse_args([]).distributed_timeout_minutes >= 30
    finally:
        sys.path.remove(str(ROOT / "examples"))
