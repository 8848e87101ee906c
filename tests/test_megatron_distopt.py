"""examples/pretrain_megatron.py with Megatron's distributed optimizer (2 ranks, torchrun, gloo):
``--dcp`` gives the losses of plain Megatron data parallel with the same optimizer, and a job
killed after a checkpoint resumes (``--load``) with the losses of the uninterrupted job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pretrain_megatron.py"
COMMON = ["--calculate-per-token-loss", "--global-batch-tokens", "1536", "--seq-length", "384",
          "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
          "--num-query-groups", "2", "--quiet", "--use-distributed-optimizer"]
ITERS = 8
TOL = 1e-5


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _cmd(extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", str(EXAMPLE), *COMMON, *extra]


def _dcp_flags() -> list[str]:
    """A budget that holds 200 tokens at degree 1 without recompute (the planner's memory model
    with the optimizer states sharded), and a small pack budget: degree 2 and recompute for the
    long sequences, degree 1 for the rest."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import pretrain_megatron

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import build_cost_model

    shape = pretrain_megatron.model_shape(pretrain_megatron.parse_args(COMMON))
    cost = build_cost_model(shape, DCPConfig(), world_size=2, zero_stage=1)
    return ["--dcp", "--dcp-pack-tokens", "256", "--dcp-hardware", "h200",
            "--dcp-memory-budget-gb", f"{cost.memory_model.memory_of(200, 1, 0) / 2**30:.6f}"]


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (torchrun starts each worker in a session of its own,
    so killing torchrun's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train(log: Path, extra: list[str]) -> list[dict]:
    done = subprocess.run(_cmd([*extra, "--log-json", str(log)]), cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    return _records(log)


@pytest.mark.timeout(600)
def test_dcp_with_distributed_optimizer_matches_plain_and_resumes_after_a_kill(tmp_path):
    dcp = _dcp_flags()
    plain = _train(tmp_path / "plain.jsonl", ["--train-iters", str(ITERS)])
    straight = _train(tmp_path / "dcp.jsonl", [*dcp, "--train-iters", str(ITERS)])
    assert [r["iteration"] for r in straight] == list(range(1, ITERS + 1))
    for a, b in zip(straight, plain):
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(b["loss"]), (a, b)
        assert a["peak_mem_mb"] > 0 and b["peak_mem_mb"] > 0
    assert straight[-1]["loss"] < straight[0]["loss"]  # it trains
    plans = [r["plan"] for r in straight]
    assert any("2" in p["degrees"] for p in plans) and any(max(p["recompute_layers"]) > 0
                                                          for p in plans)

    # a job killed after its iteration-2 checkpoint; a new job resumes from it
    ckpt = tmp_path / "ckpt"
    job = subprocess.Popen(_cmd([*dcp, "--train-iters", str(ITERS), "--save", str(ckpt),
                                 "--save-interval", "2"]),
                           cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and job.poll() is None and not (ckpt / "latest").exists():
            time.sleep(0.05)
        assert (ckpt / "latest").exists(), "no checkpoint written"
    finally:
        if job.poll() is None:
            _kill_tree(job.pid)
        job.wait()
    resumed = _train(tmp_path / "resumed.jsonl", [*dcp, "--train-iters", str(ITERS), "--load",
                                                  str(ckpt)])
    want = {r["iteration"]: r["loss"] for r in straight}
    saved = int((ckpt / "latest").read_text().split("_")[1])
    assert [r["iteration"] for r in resumed] == list(range(saved + 1, ITERS + 1))
    assert resumed, "the job was killed after its last checkpoint: nothing resumed"
    for r in resumed:
        assert abs(r["loss"] - want[r["iteration"]]) <= TOL * abs(want[r["iteration"]])


@pytest.mark.timeout(120)
def test_loading_with_another_optimizer_is_a_clear_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    _train(tmp_path / "a.jsonl", ["--train-iters", "1", "--save", str(ckpt)])
    cmd = [c for c in _cmd(["--train-iters", "2", "--load", str(ckpt)])
           if c != "--use-distributed-optimizer"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=110)
    assert done.returncode != 0
    assert "distributed_optimizer=True (this run: False)" in done.stderr
