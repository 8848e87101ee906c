"""DeepSpeed + DCP, launched the way users launch (the ``deepspeed`` launcher, gloo on CPU).

One launch per world size runs this file as the training script: in one job it calls
``examples/pretrain.py``'s ``main`` several times (DeepSpeed initialised afresh each time) and
compares, on rank 0, the loss of every iteration with ``--dcp`` against plain DeepSpeed data
parallel on the same global batches, for ZeRO stages 0 and 1 (fp32, relative error <= 1e-5;
ZeRO-2/3 with their sharding kept: tests/test_lockstep_deepspeed.py). The
memory budget is the smallest in which the planner fits the longest (512-token) sequence, so it
must use sequence-parallel groups, activation checkpointing and a different number of
micro-steps per rank. The world-size-2 launch also checks stop-and-resume from a checkpoint,
bf16 at ZeRO-2 (loose tolerance), ``--dcp_loss_reduction sequence`` with and without ``--dcp``,
and the start-up errors for bad input; one more launch runs ``examples/pretrain.py`` itself with
a bad flag. Each part of a launch is its own test case: a part that raises is reported (with its
traceback) by its case, and the parts after it still run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from distributed import JOB_ENV, deepspeed_command, launch_deepspeed, smallest_budget_gb

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parents[1]
ITERS = 5
REL_TOL = 1e-5
COMMON = ["--train-iters", str(ITERS), "--global-batch-tokens", "2048", "--seq-length", "512",
          "--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seed", "7", "--quiet"]


# ---------------------------------------------------------------------- the driver (in the job)
def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _losses(path: str) -> list[float]:
    return [r["loss"] for r in _records(path)]


def _run(pretrain, args: list[str]) -> None:
    pretrain.main(args)


H200 = ["--dcp_hardware", "h200"]
"""The hardware `_tight_budget` plans with (offline ``auto``): the runs must use it too."""


def _tight_budget(world: int, stage: int) -> str:
    """The smallest memory budget (GiB) in which the planner fits a 512-token sequence at all
    (bisection on make_plan): the longest sequences then need every rank, shorter ones fewer."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models.decoder import DecoderConfig
    from megatron_dcp.plan import make_plan
    from megatron_dcp.plan.model import ModelShape

    c = DecoderConfig(vocab_size=257, hidden_size=32, num_layers=2, num_heads=4, max_position=512)
    shape = ModelShape(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=c.ffn_hidden_size,
                       vocab_size=257, num_kv_heads=4, max_position=512, name="decoder")

    return smallest_budget_gb(
        lambda gib: make_plan([512], world_size=world, model=shape, zero_stage=stage,
                              config=DCPConfig(enabled=True, memory_budget_gb=gib)), 0.5, 64.0)


def _stage_parity(pretrain, work: str, world: int, rank: int, stage: int) -> dict:
    """Losses with and without --dcp at ZeRO ``stage``, the plans and the calibration rows."""
    budget = ["--dcp_memory_budget_gb", _tight_budget(world, stage), *H200]
    logs = {}
    for mode in ("dcp", "dp"):
        log = os.path.join(work, f"s{stage}_{mode}.jsonl")
        flags = ["--dcp", *budget] if mode == "dcp" else []
        _run(pretrain, COMMON + ["--zero-stage", str(stage), "--log-json", log, *flags])
        logs[mode] = log
    if rank != 0:
        return {}
    got = {m: _losses(p) for m, p in logs.items()}
    got["plans"] = [r["plan"] for r in _records(logs["dcp"])]
    got["calibration"] = [(r["predicted_s"], r["calibration_error"])
                          for r in _records(logs["dcp"])]
    return got


def _resume(pretrain, work: str, world: int, rank: int) -> list:
    """Stop after 3 iterations with a checkpoint, resume it to the end (ZeRO-1, --dcp)."""
    budget = ["--dcp_memory_budget_gb", _tight_budget(world, 1), *H200]
    ckpt, log = os.path.join(work, "ckpt"), os.path.join(work, "resume.jsonl")
    _run(pretrain, COMMON + ["--train-iters", "3", "--zero-stage", "1", "--dcp", *budget,
                             "--save", ckpt, "--log-json", log])
    _run(pretrain, COMMON + ["--zero-stage", "1", "--dcp", *budget, "--load", ckpt,
                             "--log-json", log])
    return _losses(log) if rank == 0 else []


def _bf16(pretrain, work: str, world: int, rank: int) -> dict:
    """bf16 (DeepSpeed's mixed-precision optimizer path) at ZeRO-2, with and without --dcp."""
    cfg = os.path.join(work, "bf16.json")
    with open(cfg, "w") as f:
        json.dump({"gradient_clipping": 1.0, "bf16": {"enabled": True},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}, f)
    out = {}
    for mode in ("dcp", "dp"):
        log = os.path.join(work, f"bf16_{mode}.jsonl")
        flags = ["--dcp", "--dcp_memory_budget_gb", _tight_budget(world, 2),
                 *H200] if mode == "dcp" else []
        _run(pretrain, COMMON + ["--zero-stage", "2", "--deepspeed_config", cfg, "--log-json",
                                 log, *flags])
        out[mode] = _losses(log) if rank == 0 else []
    return out


def _sequence_loss(pretrain, work: str, world: int, rank: int) -> dict:
    """loss_reduction="sequence" (mean of per-sequence means) with and without --dcp."""
    budget = ["--dcp_memory_budget_gb", _tight_budget(world, 1), *H200]
    out = {}
    for mode in ("dcp", "dp"):
        log = os.path.join(work, f"seq_{mode}.jsonl")
        flags = ["--dcp", *budget] if mode == "dcp" else []
        _run(pretrain, COMMON + ["--train-iters", "3", "--zero-stage", "1",
                                 "--dcp_loss_reduction", "sequence", "--log-json", log, *flags])
        out[mode] = _losses(log) if rank == 0 else []
    return out


def _bad_input(pretrain, work: str, world: int, rank: int) -> dict:
    """The start-up error of each bad DeepSpeed config (None: none raised)."""
    from megatron_dcp.config import DCPConfigError

    errors = {}
    cases = {
        "unknown_key": {"gradient_clipping": 1.0, "dcp": {"max_degre": 2}},
        "degree_cap": {"gradient_clipping": 1.0, "dcp": {"max_degree": world * 2}},
        "sequence_parallel": {"gradient_clipping": 1.0, "sequence_parallel_size": 2, "dcp": {}},
    }
    for name, cfg in cases.items():
        path = os.path.join(work, f"{name}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        try:
            _run(pretrain, COMMON + ["--deepspeed_config", path])
            errors[name] = None
        except DCPConfigError as e:
            errors[name] = str(e)
    return errors


def _driver(stages: list[int], out: str, resume: bool, bad_input: bool) -> None:
    """Every part in turn; a part that raises is reported as {"failed": traceback} and the
    next part still runs (each part is its own test case on the pytest side)."""
    import traceback

    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain

    work = out + ".d"  # shared by the ranks (checkpoints: rank 0 writes the "latest" tag)
    os.makedirs(work, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    parts = [(f"stage{stage}", _stage_parity, (stage,)) for stage in stages]
    if resume:
        parts += [("resume", _resume, ()), ("bf16", _bf16, ()), ("sequence", _sequence_loss, ())]
    if bad_input:
        parts += [("errors", _bad_input, ())]
    report: dict = {}
    for name, part, args in parts:
        try:
            report[name] = part(pretrain, work, world, rank, *args)
        except Exception:  # noqa: BLE001 - reported as this part's failure
            report[name] = {"failed": f"rank {rank}: " + traceback.format_exc()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()


# ---------------------------------------------------------------------- the tests (pytest side)
def _part(world_size: int, name: str):
    """What part ``name`` of the one launch of ``world_size`` reported (run on first use); a
    part that raised fails its own test with its traceback."""
    if world_size not in _LAUNCHES:
        if world_size == 2:
            _LAUNCHES[2] = _launch_driver(2, [0, 1], resume=True, bad_input=True, timeout=380)
        else:
            _LAUNCHES[4] = _launch_driver(4, [0, 1], resume=False, bad_input=False, timeout=380)
    got = _LAUNCHES[world_size].get(name)
    if got is None:  # every test asks only for a part its world size runs
        pytest.fail(f"part {name!r} of the world-size-{world_size} launch reported nothing: "
                    f"{sorted(_LAUNCHES[world_size])}")
    if isinstance(got, dict) and "failed" in got:
        pytest.fail(got["failed"])
    return got


_LAUNCHES: dict = {}


def _check_parity(got: dict, stage: int, require_uneven: bool) -> None:
    dcp, dp = got["dcp"], got["dp"]
    assert len(dcp) == len(dp) == ITERS, got
    for i, (a, b) in enumerate(zip(dcp, dp)):
        assert abs(a - b) <= REL_TOL * abs(b), f"ZeRO {stage} iteration {i + 1}: dcp {a} vs dp {b}"
    assert dcp[-1] < dcp[0]  # it trains
    plans = got["plans"]  # the planner really regrouped: SP degrees > 1, uneven micro-steps
    assert any(int(d) > 1 for p in plans for d in p["degrees"]), plans
    if require_uneven:
        assert any(len(set(p["micro_steps_per_rank"])) > 1 for p in plans), plans
    calibration = got["calibration"]  # every row predicts; the error is known from step 1
    assert all(pred > 0 and err is not None for pred, err in calibration), calibration


def _launch_driver(world_size: int, stages: list[int], resume: bool, bad_input: bool,
                   timeout: int) -> dict:
    out = tempfile.mktemp(suffix=".json")
    flags = ["--stages", ",".join(map(str, stages)), "--out", out]
    flags += ["--resume"] if resume else []
    flags += ["--bad-input"] if bad_input else []
    proc = launch_deepspeed(world_size, [__file__, *flags], timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size, stage", [(2, 0), (2, 1), (4, 0), (4, 1)],
                         ids=["w2-zero0", "w2-zero1", "w4-zero0", "w4-zero1"])
def test_parity(world_size, stage):
    _check_parity(_part(world_size, f"stage{stage}"), stage, require_uneven=world_size == 4)


@pytest.mark.timeout(400)
def test_stop_and_resume_matches_straight_run():
    """Stop after 3 iterations, resume from the checkpoint: the same losses as without stopping."""
    resumed, straight = _part(2, "resume"), _part(2, "stage1")["dcp"]
    assert len(resumed) == ITERS
    for a, b in zip(resumed, straight):
        assert abs(a - b) <= REL_TOL * abs(b), (resumed, straight)


@pytest.mark.timeout(400)
def test_bf16_zero2_agrees():
    bf16 = _part(2, "bf16")  # bf16 rounding differs between plans: a loose tolerance
    assert len(bf16["dcp"]) == ITERS
    assert all(abs(a - b) <= 5e-3 * b for a, b in zip(bf16["dcp"], bf16["dp"])), bf16


@pytest.mark.timeout(400)
def test_sequence_loss_reduction_agrees():
    by_seq, by_token = _part(2, "sequence"), _part(2, "stage1")["dp"]
    assert len(by_seq["dcp"]) == 3
    for a, b in zip(by_seq["dcp"], by_seq["dp"]):
        assert abs(a - b) <= REL_TOL * abs(b), by_seq
    assert abs(by_seq["dp"][0] - by_token[0]) > 1e-4 * by_token[0]  # another loss than "token"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case, message", [
    ("unknown_key", ["unknown key(s)", "max_degre"]),
    ("degree_cap", ["exceeds the DCP world size 2"]),
    ("sequence_parallel", ["sequence_parallel_size=2"])])
def test_bad_deepspeed_config_fails_at_start(case, message):
    error = _part(2, "errors")[case]
    assert error is not None and all(m in error for m in message), error


@pytest.mark.timeout(240)
def test_kill_and_resume_across_processes(tmp_path):
    """Kill a running job after its iteration-3 checkpoint; a new job resumes from it and
    reproduces the losses of an uninterrupted job (same data position, optimizer, planner)."""
    import signal
    import time

    budget = ["--dcp_memory_budget_gb", _tight_budget(2, 2)]
    args = COMMON + ["--dcp", *budget, "--zero-stage", "2", "--train-iters", "6"]
    straight = tmp_path / "straight.jsonl"
    proc = launch_deepspeed(2, ["examples/pretrain.py", *args, "--log-json", str(straight)],
                            timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    ckpt, killed = tmp_path / "ckpt", tmp_path / "killed.jsonl"
    cmd = deepspeed_command(2, "examples/pretrain.py", *args, "--save", str(ckpt),
                            "--save-interval", "3", "--log-json", str(killed))
    job = subprocess.Popen(cmd, cwd=ROOT, env=JOB_ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        deadline = time.time() + 100
        while time.time() < deadline and job.poll() is None:
            if (ckpt / "latest").exists():
                break
            time.sleep(0.05)
        assert (ckpt / "latest").exists(), "no checkpoint written"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # this job's own process group
        job.wait()
    resumed = tmp_path / "resumed.jsonl"
    proc = launch_deepspeed(2, ["examples/pretrain.py", *args, "--load", str(ckpt), "--log-json",
                       str(resumed)],
                   timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    want = {r["iteration"]: r["loss"] for r in _records(str(straight))}
    got = _records(str(resumed))
    assert [r["iteration"] for r in got] == [4, 5, 6]
    for r in got:
        assert abs(r["loss"] - want[r["iteration"]]) <= REL_TOL * want[r["iteration"]], (got, want)


@pytest.mark.timeout(120)
def test_pretrain_bad_flag_fails_at_start():
    proc = launch_deepspeed(2, ["examples/pretrain.py", "--dcp", "--dcp_max_degree", "3", *COMMON],
                   timeout=110)
    assert proc.returncode != 0
    assert "dcp.max_degree=3 exceeds the DCP world size 2" in proc.stdout + proc.stderr


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--stages", default="0,1")
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--bad-input", action="store_true")
    a = p.parse_args()
    try:
        _driver([int(s) for s in a.stages.split(",")], a.out, a.resume, a.bad_input)
    finally:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()
