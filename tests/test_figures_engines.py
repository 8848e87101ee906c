"""The figures through the engines end to end: ``examples/pretrain.py --dcp`` on 2 DeepSpeed
ranks with ``csv_monitor`` in its DeepSpeed JSON writes every figure of every iteration to
DeepSpeed's CSV files (and TensorBoard event files and an offline W&B run, where those are
installed) at DeepSpeed's own step axis, equal to the ``--log-json`` rows' figures, and
``dcp-report`` draws the log."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess

import pytest

from distributed import JOB_ENV, deepspeed_command

pytestmark = pytest.mark.slow  # launches DeepSpeed ranks


@pytest.mark.timeout(240)
def test_deepspeed_monitor_csv_equals_the_json_log(tmp_path, tools_on_path):
    """DeepSpeed's csv_monitor, and its tensorboard and wandb monitors where installed."""
    config = json.loads((tools_on_path.parent / "examples" / "ds_config.json").read_text())
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    if tensorboard:
        config["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb"),
                                 "job_name": "run"}
    wandb = importlib.util.find_spec("wandb") is not None
    if wandb:  # offline: never reaching a server
        config["wandb"] = {"enabled": True, "project": "dcp-test"}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    log = tmp_path / "run.jsonl"
    cmd = deepspeed_command(2, "examples/pretrain.py", "--dcp", "--deepspeed_config",
                            str(tmp_path / "ds.json"), "--train-iters", "3",
                            "--global-batch-tokens", "2048", "--seq-length", "512",
                            "--num-layers", "2", "--hidden-size", "32", "--num-heads", "4",
                            "--dcp_hardware", "h200", "--quiet", "--log-json", str(log))
    env = dict(JOB_ENV, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env["PYTHONPATH"],  # and where this
                                                      os.environ.get("PYTHONPATH")]))  # finds tb
    proc = subprocess.run(cmd, cwd=tools_on_path.parent, env=env, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in log.open()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    def csv_rows(name):
        with open(tmp_path / "run" / f"{name}.csv") as f:
            return [(int(step), float(value)) for step, value in list(csv.reader(f))[1:]]

    # DeepSpeed's own step axis (global samples), one step per iteration
    steps = [step for step, _ in csv_rows("Train_Samples_lr")]
    assert len(steps) == 3 and steps == sorted(set(steps))
    for name in ("loss", "tokens_per_s", "mfu", "model_tflop", "micro_steps_max",
                 "prediction_error"):
        assert csv_rows(f"dcp_{name}") == \
            [(step, r["figures"][name]) for step, r in zip(steps, rows)], name
    assert rows[0]["figures"]["tokens"] == rows[0]["tokens"]
    if tensorboard:
        from test_figures_monitors import read_tensorboard

        scalars = read_tensorboard(tmp_path / "tb" / "run")
        for step, r in zip(steps, rows):
            for name, value in r["figures"].items():
                assert scalars[("dcp/" + name, step)] == \
                    pytest.approx(value, rel=1e-6, abs=1e-30), name
    if wandb:
        from test_figures_monitors import read_wandb_offline_history

        history = read_wandb_offline_history(next((tmp_path / "wandb").glob("offline-run-*")))
        for step, r in zip(steps, rows):
            assert {k: v for k, v in history[step].items() if k.startswith("dcp/")} == \
                pytest.approx({"dcp/" + k: v for k, v in r["figures"].items()}, rel=1e-12)
    from test_report_page import assert_report_fields

    assert_report_fields(rows, engine="deepspeed")
    import report

    assert report.main([str(log), "--dpi", "40"]) == 0
    assert (tmp_path / "run.png").stat().st_size > 10_000


@pytest.mark.timeout(200)
def test_megatron_example_rows_carry_the_figures(tmp_path):
    """``examples/pretrain_megatron.py --dcp``: each row's figures, timed over the whole
    iteration (the optimizer step after the driver's included), as the row's step_s."""
    from test_megatron_example import _budget_gb, _train

    rows = _train(tmp_path, "dcp", ["--dcp", "--dcp-hardware", "h200",
                                    "--dcp-memory-budget-gb", f"{_budget_gb(200):.6f}"])
    for row in rows:
        figures = row["figures"]
        assert figures["step_s"] == row["step_s"] and figures["tokens"] == row["tokens"]
        assert figures["loss"] == pytest.approx(row["loss"], rel=1e-6)
        assert {"mfu", "model_tflop", "plan_efficiency", "micro_steps_max"} <= set(figures)
    from test_report_page import assert_report_fields

    assert_report_fields(rows, engine="megatron-core")
