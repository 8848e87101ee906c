"""examples/pretrain_megatron.py with pipeline parallelism: DP 2 x PP 2 (4 ranks, torchrun on
gloo). Plain mode runs Megatron's own 1F1B schedule over per-stage models (embedding on the
first stage, output layer on the last); ``--dcp`` runs the plan's lockstep slots through the same
schedule. On the same data the losses per iteration agree within 1e-5, with sequences split over
both pipelines (degree 2) in the plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pretrain_megatron.py"
COMMON = ["--calculate-per-token-loss", "--train-iters", "3", "--global-batch-tokens", "1536",
          "--seq-length", "384", "--num-layers", "2", "--hidden-size", "32",
          "--num-attention-heads", "4", "--num-query-groups", "2",
          "--pipeline-model-parallel-size", "2", "--distributed-timeout-minutes", "2", "--quiet"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _budget_gb(tokens: int) -> float:
    """Memory per rank (GiB) the cost model gives a degree-1 task of ``tokens`` tokens on one
    stage of this pipeline (the example's ModelShape carries pipeline_parallel=2)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import pretrain_megatron
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import build_cost_model

    shape = pretrain_megatron.model_shape(pretrain_megatron.parse_args(COMMON))
    assert shape.pipeline_parallel == 2
    cost = build_cost_model(shape, DCPConfig(), world_size=2, zero_stage=0)  # as DCPForwardBackward
    return cost.memory_of(tokens, 1, 0) / 2**30


def _train(tmp_path: Path, name: str, extra: list[str]) -> list[dict]:
    log = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(EXAMPLE), *COMMON, *extra, "--log-json", str(log)]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done:" in done.stdout
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.timeout(320)
def test_dcp_dp2_pp2_loss_per_iteration_equals_plain_pipeline(tmp_path):
    # a budget of 400 tokens at degree 1 (less what 1F1B holds in flight) makes the planner split
    # the long sequences over both pipelines (degree 2)
    dcp = _train(tmp_path, "dcp", ["--dcp", "--dcp-pack-tokens", "256", "--dcp-hardware", "h200",
                                   "--dcp-memory-budget-gb", f"{_budget_gb(400):.6f}"])
    plain = _train(tmp_path, "plain", [])
    assert [r["iteration"] for r in dcp] == [r["iteration"] for r in plain] == [1, 2, 3]
    for a, b in zip(dcp, plain):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    assert dcp[0]["plan"]["mode"] == "dcp" and plain[0]["plan"]["mode"] == "data-parallel"
    assert "2" in dcp[0]["plan"]["degrees"], dcp[0]["plan"]
