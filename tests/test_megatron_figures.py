"""The figures through the Megatron-LM launcher (megatron-core 0.19's ``megatron.training``,
the Python 3.12 leg): ``--dcp-log-json`` rows carry them, timed from step to step; a dashboard
flag (``--tensorboard-dir``) without its package fails at start naming the extra."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("megatron.training", reason="Megatron-LM's training package (megatron-core "
                    "0.19, Python 3.12: the .venv312 leg of make test)")
pytestmark = pytest.mark.slow  # every test here launches processes

from test_megatron_launcher import _launch  # noqa: E402
from test_report_page import assert_report_fields  # noqa: E402


@pytest.mark.timeout(300)
def test_launcher_rows_carry_the_figures(tmp_path):
    log = tmp_path / "dcp.jsonl"
    done = _launch(["--dcp", "--dcp-log-json", str(log), "--dcp-hardware", "h200",
                    "--dcp-max-tokens-per-rank", "200", "--train-iters", "3"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for row in rows:
        figures = row["figures"]
        assert figures["loss"] == pytest.approx(row["loss"], rel=1e-5)
        assert {"mfu", "model_tflop", "tokens_per_s", "plan_efficiency",
                "micro_steps_max", "step_s"} <= set(figures)
    assert any(r["figures"].get("tokens_degree_2", 0) > 0 for r in rows)  # documents split
    assert_report_fields(rows, engine="megatron-lm")


@pytest.mark.timeout(120)
def test_tensorboard_dir_without_tensorboard_fails_at_start(tmp_path):
    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    done = _launch(["--dcp", "--tensorboard-dir", str(tmp_path / "tb")])
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "--tensorboard-dir needs tensorboard" in out and "megatron-dcp[monitor]" in out
    assert "iteration        1/" not in out


@pytest.mark.timeout(300)
def test_launcher_figures_in_megatron_lms_tensorboard(tmp_path):
    """``--tensorboard-dir``: Megatron-LM's own event files hold its scalars and every figure
    under ``dcp/`` at each --log-interval iteration, equal to the --dcp-log-json rows'."""
    pytest.importorskip("tensorboard")
    from test_figures_monitors import read_tensorboard

    log, tb = tmp_path / "dcp.jsonl", tmp_path / "tb"
    done = _launch(["--dcp", "--dcp-log-json", str(log), "--dcp-hardware", "h200",
                    "--dcp-max-tokens-per-rank", "200", "--train-iters", "4",
                    "--log-interval", "2", "--tensorboard-dir", str(tb)])
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = {r["iteration"]: r for r in map(json.loads, log.read_text().splitlines())}
    scalars = read_tensorboard(tb)
    ours = {key: value for key, value in scalars.items() if key[0].startswith("dcp/")}
    assert {step for _, step in ours} == {2, 4}
    for it in (2, 4):
        figures = rows[it]["figures"]
        assert {name for name, step in ours if step == it} == {"dcp/" + k for k in figures}
        for name, value in figures.items():
            assert ours[("dcp/" + name, it)] == pytest.approx(value, rel=1e-6, abs=1e-30)
    assert any(not tag.startswith("dcp/") for tag, _ in scalars)  # beside Megatron-LM's own


@pytest.mark.timeout(300)
def test_launcher_figures_in_megatron_lms_wandb_run(tmp_path, monkeypatch):
    """``--wandb-project`` in offline mode (never reaching a server): Megatron-LM's own W&B run
    holds every figure under ``dcp/`` at each --log-interval iteration, as the JSON rows."""
    pytest.importorskip("wandb")
    from test_figures_monitors import read_wandb_offline_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log, save = tmp_path / "dcp.jsonl", tmp_path / "wandb"
    done = _launch(["--dcp", "--dcp-log-json", str(log), "--dcp-hardware", "h200",
                    "--dcp-max-tokens-per-rank", "200", "--train-iters", "4",
                    "--log-interval", "2", "--wandb-project", "dcp-test", "--wandb-exp-name",
                    "figures", "--wandb-save-dir", str(save)])
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = {r["iteration"]: r for r in map(json.loads, log.read_text().splitlines())}
    history = read_wandb_offline_history(next((save / "wandb").glob("offline-run-*")))
    for it in (2, 4):
        ours = {k: v for k, v in history[it].items() if k.startswith("dcp/")}
        assert ours == pytest.approx({"dcp/" + k: v for k, v in rows[it]["figures"].items()},
                                     rel=1e-12)
    assert sorted(history) == [2, 4]  # (Megatron-LM logs its own to W&B only with TensorBoard)
