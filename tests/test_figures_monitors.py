"""The figures in the engines' dashboards: Megatron-LM's TensorBoard / W&B writers at its
--log-interval (`megatron_dcp.megatron.lm_monitor`) and DeepSpeed's ``engine.monitor``
(`deepspeed_plugin.monitor`, its real csv_monitor too), each equal to the JSON log's figures;
a dashboard asked for without its package fails naming the extra."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from conftest import figures_driver

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan import load_model, make_plan
from megatron_dcp.runtime.figures import MONITOR_EXTRA, StepFigures
from megatron_dcp.runtime.report import TrainingLog, plan_summary


class TensorBoardDouble:
    """Records ``add_scalar(name, value, step)`` as a SummaryWriter receives it."""

    def __init__(self):
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))


class WandbDouble:
    """Records ``log(values, step)`` as a W&B run receives it."""

    def __init__(self):
        self.logged: list[tuple[dict, int]] = []

    def log(self, values, step):
        self.logged.append((dict(values), step))


class DeepSpeedMonitorDouble:
    """DeepSpeed's ``MonitorMaster`` as the plugin sees it: ``enabled``, ``write_events``."""

    def __init__(self, enabled=True):
        self.enabled = enabled
        self.events: list[tuple[str, float, int]] = []

    def write_events(self, events):
        self.events.extend(events)


def _steps(n=4):
    """(figures of a run, ``n`` step results on 4 ranks of gpt-1b on H100s)."""
    shape, config = load_model("gpt-1b"), DCPConfig(enabled=True, hardware="h100")
    driver = figures_driver(config, shape)
    results = []
    for it in range(1, n + 1):
        lengths = [500 * it, 9000, 300, 2000 + 100 * it]
        plan = make_plan(lengths, world_size=4, model=shape, config=config, hardware="h100")
        results.append(SimpleNamespace(plan=plan, loss=3.0 / it, grad_norm=0.5, wall_s=40.0,
                                       skipped=False, predicted_s=0.3, calibration_error=0.2,
                                       plan_s=0.01, plan_wait_s=0.0, tokens=plan.target_tokens))
    return StepFigures(driver), results


def _json_figures(tmp_path, figures, results) -> dict[int, dict[str, float]]:
    """The rows' figures as the JSON log holds them (written and read back)."""
    path = tmp_path / "run.jsonl"
    log = TrainingLog("dcp", len(results), json_path=str(path), quiet=True)
    for it, r in enumerate(results, 1):
        log.iteration(it, loss=r.loss, tokens=1, step_s=r.wall_s, plan=plan_summary(r.plan),
                      figures=figures(r))
    log.close()
    return {row["iteration"]: row["figures"] for row in map(json.loads, path.open())}


def test_megatron_writers_get_every_figure_at_the_log_interval(tmp_path):
    from megatron_dcp.megatron.lm_monitor import LMMonitor

    figures, results = _steps(4)
    tb, wandb = TensorBoardDouble(), WandbDouble()
    monitor = LMMonitor(2, tb, wandb)
    for it, r in enumerate(results, 1):
        monitor.write(it, figures(r))
    logged = _json_figures(tmp_path, figures, results)
    assert sorted({step for _, _, step in tb.scalars}) == [2, 4]
    for it in (2, 4):
        assert {name: value for name, value, step in tb.scalars if step == it} == \
            {"dcp/" + k: v for k, v in logged[it].items()}
    assert [(values, step) for values, step in wandb.logged] == \
        [({"dcp/" + k: v for k, v in logged[it].items()}, it) for it in (2, 4)]
    names = set(wandb.logged[0][0])
    assert {"dcp/mfu", "dcp/tokens_per_s", "dcp/plan_efficiency", "dcp/idle_share",
            "dcp/tokens_run", "dcp/tokens_run_per_s"} <= names
    # trained (the targets: n - 1 a sequence here) apart from run (the plan's lengths)
    first = wandb.logged[0][0]
    assert first["dcp/tokens"] == results[1].plan.target_tokens
    assert first["dcp/tokens_run"] == sum(results[1].plan.lengths)
    assert any(name.startswith("dcp/tokens_degree_") for name in names)


def test_megatron_ranks_without_writers_write_nothing():
    from megatron_dcp.megatron.lm_monitor import LMMonitor

    monitor = LMMonitor(2, asked=True)  # the job has dashboards, on another rank
    assert not monitor.active and not monitor.due(2)
    assert monitor.due_on_some_rank(2) and not monitor.due_on_some_rank(3)
    monitor.write(2, {"loss": 1.0})  # nothing to write to: no error
    assert not LMMonitor(1).due_on_some_rank(1)  # no dashboards anywhere


def test_megatron_writers_are_megatron_lms_own(monkeypatch):
    """`LMMonitor.of_megatron` takes the writers Megatron-LM's global_vars hold (stood in for
    here: megatron-core 0.16's wheel ships no megatron.training)."""
    from megatron_dcp.megatron.lm_monitor import LMMonitor

    tb, wandb = TensorBoardDouble(), WandbDouble()
    global_vars = ModuleType("megatron.training.global_vars")
    global_vars.get_tensorboard_writer = lambda: tb
    global_vars.get_wandb_writer = lambda: wandb
    training = ModuleType("megatron.training")
    training.global_vars = global_vars
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    monitor = LMMonitor.of_megatron(SimpleNamespace(log_interval=5))
    assert (monitor.tensorboard, monitor.wandb, monitor.log_interval) == (tb, wandb, 5)


def _without(monkeypatch, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))


@pytest.mark.parametrize("flag,package", [("tensorboard_dir", "tensorboard"),
                                          ("wandb_project", "wandb")])
def test_megatron_dashboard_without_its_package_fails_naming_the_extra(monkeypatch, flag,
                                                                       package):
    from megatron_dcp.megatron.lm_monitor import check_monitor_args

    _without(monkeypatch, package)
    args = SimpleNamespace(tensorboard_dir=None, wandb_project=None)
    check_monitor_args(args)  # nothing asked: fine
    setattr(args, flag, "x")
    with pytest.raises(ImportError, match=f"--{flag.replace('_', '-')} needs {package}.*"
                                          + MONITOR_EXTRA.replace("[", r"\[")):
        check_monitor_args(args)


def test_deepspeed_monitor_gets_every_figure_on_rank_0(tmp_path):
    from deepspeed_plugin.monitor import DeepSpeedMonitor

    figures, results = _steps(3)
    engine = SimpleNamespace(monitor=DeepSpeedMonitorDouble(), global_samples=0)
    written = DeepSpeedMonitor(engine, figures, rank=0)
    for it, r in enumerate(results, 1):
        engine.global_samples = 8 * it  # DeepSpeed's step axis
        assert written.write(r) is figures(r)
    logged = _json_figures(tmp_path, figures, results)
    assert {(name, step): value for name, value, step in engine.monitor.events} == \
        {("dcp/" + k, 8 * it): v for it, f in logged.items() for k, v in f.items()}
    for rank, enabled in ((1, True), (0, False)):  # another rank; no monitor in the JSON
        other = SimpleNamespace(monitor=DeepSpeedMonitorDouble(enabled), global_samples=8)
        assert DeepSpeedMonitor(other, figures, rank=rank).write(results[0]) is None
        assert other.monitor.events == []


def test_deepspeed_csv_monitor_files_hold_the_figures(tmp_path, monkeypatch):
    """DeepSpeed's own MonitorMaster with ``csv_monitor`` enabled: one CSV per figure."""
    import deepspeed.comm as ds_dist
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    from deepspeed_plugin.monitor import DeepSpeedMonitor

    monkeypatch.setattr(ds_dist, "get_rank", lambda *a, **k: 0)  # rank 0 without a group
    config = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                              "job_name": "run"}}
    engine = SimpleNamespace(monitor=MonitorMaster(get_monitor_config(config)))
    figures, results = _steps(2)
    monitor = DeepSpeedMonitor(engine, figures, rank=0)
    for it, r in enumerate(results, 1):
        engine.global_samples = it
        monitor.write(r)
    logged = _json_figures(tmp_path, figures, results)
    for name in ("mfu", "tokens_per_s", "tokens_run_per_s", "loss", "micro_steps_max"):
        with open(tmp_path / "run" / f"dcp_{name}.csv") as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["step", name]
        assert [(int(s), float(v)) for s, v in rows[1:]] == \
            [(it, logged[it][name]) for it in (1, 2)]


@pytest.mark.parametrize("section,package", [("tensorboard", "tensorboard"),
                                             ("wandb", "wandb")])
def test_deepspeed_dashboard_without_its_package_fails_naming_the_extra(monkeypatch, section,
                                                                        package):
    from deepspeed_plugin.monitor import check_monitor_config

    _without(monkeypatch, package)
    check_monitor_config({section: {"enabled": False}, "csv_monitor": {"enabled": True}})
    with pytest.raises(ImportError, match=f'"{section}" section needs {package}'):
        check_monitor_config({section: {"enabled": True}})


def read_tensorboard(log_dir) -> dict[tuple[str, int], float]:
    """Every scalar of the TensorBoard event files under ``log_dir``: (tag, step) -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"]
            for e in events.Scalars(tag)}


def test_tensorboard_event_files_hold_the_json_figures(tmp_path):
    """Megatron-LM's writer is torch's SummaryWriter: its event files, read back with
    tensorboard's EventAccumulator, hold every figure of every logged iteration."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    from megatron_dcp.megatron.lm_monitor import LMMonitor

    figures, results = _steps(3)
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    monitor = LMMonitor(1, tensorboard=writer)
    for it, r in enumerate(results, 1):
        monitor.write(it, figures(r))
    writer.close()
    logged = _json_figures(tmp_path, figures, results)
    scalars = read_tensorboard(tmp_path / "tb")
    expected = {("dcp/" + k, it): v for it, f in logged.items() for k, v in f.items()}
    assert set(scalars) == set(expected)
    for key, value in expected.items():  # TensorBoard keeps float32
        assert scalars[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key


def read_wandb_offline_history(run_dir) -> dict[int, dict[str, float]]:
    """The history rows of an offline W&B run (its ``run-*.wandb`` file: W&B's record log of
    32 KiB blocks, each record a checksum, a length, a fragment type and a protobuf
    ``Record``), by step."""
    import struct

    from wandb.proto import wandb_internal_pb2

    raw = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, pending, rows = 32768, 7, b"", {}
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0:
            break
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                rows[int(items.pop("_step"))] = items
    return rows


@pytest.mark.slow  # wandb.init starts W&B's service process
def test_wandb_offline_history_holds_the_json_figures(tmp_path, monkeypatch):
    """A real W&B run in offline mode (never reaching a server) through `LMMonitor`, as
    Megatron-LM's ``get_wandb_writer`` gives it: its history holds every figure of every
    logged iteration, equal to the JSON log's."""
    wandb = pytest.importorskip("wandb")
    from megatron_dcp.megatron.lm_monitor import LMMonitor

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    figures, results = _steps(4)
    run = wandb.init(project="dcp-test", name="figures", dir=str(tmp_path),
                     settings=wandb.Settings(mode="offline"))
    monitor = LMMonitor(2, wandb=run)
    for it, r in enumerate(results, 1):
        monitor.write(it, figures(r))
    run_dir = Path(run.dir).parent  # .../wandb/offline-run-*/files -> the run's folder
    run.finish()
    logged = _json_figures(tmp_path, figures, results)
    history = read_wandb_offline_history(run_dir)
    for _ in range(60):  # W&B's service may still be writing the record log (a loaded machine)
        if sorted(history) == [2, 4]:
            break
        time.sleep(0.5)
        history = read_wandb_offline_history(run_dir)
    assert sorted(history) == [2, 4]
    for it in (2, 4):
        ours = {k: v for k, v in history[it].items() if k.startswith("dcp/")}
        assert ours == {"dcp/" + k: v for k, v in logged[it].items()}
