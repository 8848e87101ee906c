"""examples/pretrain_megatron.py: --dcp gives the same loss per iteration as Megatron's plain data
parallel (2 ranks, torchrun on gloo), and bad flag combinations fail at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pretrain_megatron.py"
COMMON = ["--calculate-per-token-loss", "--train-iters", "2", "--global-batch-tokens", "1536",
          "--seq-length", "384", "--num-layers", "2", "--hidden-size", "32",
          "--num-attention-heads", "4", "--num-query-groups", "2", "--quiet"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _budget_gb(tokens: int, common: list[str] = COMMON) -> float:
    """Memory per rank (GiB) the cost model gives a degree-1 task of ``tokens`` tokens (under
    pipeline parallelism: on one stage, what 1F1B holds in flight left out)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import pretrain_megatron
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import build_cost_model

    shape = pretrain_megatron.model_shape(pretrain_megatron.parse_args(common))
    cost = build_cost_model(shape, DCPConfig(), world_size=2, zero_stage=0)  # as DCPForwardBackward
    return cost.memory_model.memory_of(tokens, 1, 0) / 2**30


def _train(tmp_path: Path, name: str, extra: list[str], common: list[str] = COMMON,
           ranks: int = 2) -> list[dict]:
    log = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(ranks), str(EXAMPLE), *common, *extra, "--log-json", str(log)]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done:" in done.stdout
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.timeout(320)
def test_dcp_loss_per_iteration_equals_plain_data_parallel(tmp_path):
    # A memory budget that holds 200 tokens at degree 1 without recompute, and a small pack
    # budget, make the planner use degree 2 and/or recompute for the long sequences, degree 1
    # for the rest, and tasks on both ranks.
    dcp = _train(tmp_path, "dcp", ["--dcp", "--dcp-pack-tokens", "256", "--dcp-hardware", "h200",
                                   "--dcp-memory-budget-gb", f"{_budget_gb(200):.6f}"])
    plain = _train(tmp_path, "plain", [])
    assert [r["iteration"] for r in dcp] == [1, 2]
    for a, b in zip(dcp, plain):
        assert set(a) >= {"iteration", "loss", "tokens", "tokens_per_s", "predicted_s",
                          "calibration_error"}  # the driver calibrates Megatron's steps too
        assert a["predicted_s"] > 0 and "predicted_s" not in b
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    assert dcp[0]["plan"]["mode"] == "dcp" and plain[0]["plan"]["mode"] == "data-parallel"
    # split sequences (degree 2) in the first step; recompute where the cost model wants it
    # (tests/test_megatron.py runs recompute at every depth under DCP, exactly)
    assert "2" in dcp[0]["plan"]["degrees"], dcp[0]["plan"]


BAD_FLAGS = [
    (["--dcp"], "--calculate-per-token-loss"),
    (["--dcp", "--calculate-per-token-loss", "--context-parallel-size", "2"],
     "--context-parallel-size 1"),
    (["--dcp-max-degree", "2"], "given without --dcp"),
]
"""Bad flag combinations and what each error names."""


def test_a_bad_flag_ends_the_process_at_start():
    flags, message = BAD_FLAGS[0]
    done = subprocess.run([sys.executable, str(EXAMPLE), *flags], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert message in done.stderr
