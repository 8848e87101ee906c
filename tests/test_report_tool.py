"""``dcp-report`` (tools/report.py): a PNG and an HTML page of a run from its DCP JSON log,
every panel drawn, older and launcher rows read, a non-DCP file refused naming its line."""

from __future__ import annotations

import base64
import builtins
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

matplotlib = pytest.importorskip("matplotlib")

from conftest import figures_driver  # noqa: E402
from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.plan import load_model, make_plan  # noqa: E402
from megatron_dcp.runtime.figures import StepFigures  # noqa: E402
from megatron_dcp.runtime.report import TrainingLog, plan_summary  # noqa: E402


def _driver(config, shape):
    return figures_driver(config, shape)


def write_run_log(path: Path, iterations: int = 20, timeline_interval: int = 5) -> list:
    """A --log-json file as the examples write it (TrainingLog rows with the step's figures,
    the plan's timeline every ``timeline_interval``) for ``iterations`` planned steps of gpt-1b
    on 8 H100s, one step skipped; returns the plans."""
    shape, config = load_model("gpt-1b"), DCPConfig(enabled=True, hardware="h100")
    figures = StepFigures(_driver(config, shape))
    log = TrainingLog("dcp", iterations, json_path=str(path), quiet=True,
                      timeline_interval=timeline_interval)
    plans = []
    for it in range(1, iterations + 1):
        lengths = [64 * ((it * 37 + 11 * k) % 400 + 1) for k in range(24)]
        plan = make_plan(lengths, world_size=8, model=shape, config=config, hardware="h100",
                         iteration=it)
        predicted = plan.makespan + 0.02
        result = SimpleNamespace(plan=plan, loss=8.0 / it, grad_norm=1.0, skipped=it == 7,
                                 wall_s=predicted * (1.3 - 0.01 * it), predicted_s=predicted,
                                 calibration_error=0.3 / it, plan_s=0.01, plan_wait_s=0.001,
                                 tokens=plan.target_tokens)
        log.iteration(it, loss=result.loss, tokens=result.tokens,
                      step_s=result.wall_s, plan=plan_summary(plan, plan_s=0.01),
                      predicted_s=predicted, calibration_error=result.calibration_error,
                      skipped=result.skipped, figures=figures(result), step_plan=plan)
        plans.append(plan)
    log.close()
    return plans


@pytest.fixture
def tool(tools_on_path):
    import report

    return report


def test_png_and_html_of_a_run(tool, tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    write_run_log(log)
    capsys.readouterr()  # the log's final line
    assert tool.main([str(log), "--dpi", "50"]) == 0
    png, page = tmp_path / "run.png", tmp_path / "run.html"
    assert capsys.readouterr().out.split() == ["wrote", str(png), "wrote", str(page)]
    height, width = matplotlib.image.imread(png).shape[:2]
    assert (width, height) == (13 * 50, 13 * 50)
    text = page.read_text()
    assert base64.b64encode(png.read_bytes()).decode() in text  # the page holds the image
    # (the page in a browser: tests/test_report_page.py)
    assert "iterations</th><td>20<" in text and "MFU (mean)" in text


def test_every_panel_is_drawn(tool, tmp_path):
    log = tmp_path / "run.jsonl"
    write_run_log(log)
    fig = tool.draw(tool.read_log(str(log)))
    axes = {ax.get_title().split(" of iteration")[0]: ax for ax in fig.axes if ax.get_title()}
    assert list(axes) == list(tool.PANELS)
    for title, ax in axes.items():
        assert ax.get_lines() or ax.collections, f"panel {title!r} is empty"
        assert not ax.texts, f"panel {title!r} says its figures are missing"
    twins = [ax for ax in fig.axes if not ax.get_title()]
    assert len(twins) == 1 and twins[0].get_ylabel() == "MFU %"
    degrees = axes["degree mix"].get_legend_handles_labels()[1]
    assert degrees and all(label.startswith("degree ") for label in degrees)
    matplotlib.pyplot.close(fig)


def _bars(ax) -> list[tuple[float, float, float]]:
    """(rank, x start, width) of every bar `timeline_plot.draw_timeline` drew on ``ax``."""
    out = []
    for collection in ax.collections:
        for path in collection.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            out.append(((y0 + y1) / 2, x0, x1 - x0))
    return sorted(out)


def _same_bars(ax, plan) -> bool:
    """One bar per task and rank, at the task's predicted start (microseconds) for its
    duration."""
    want = sorted((float(r), t.start, t.duration) for t in plan.tasks for r in t.ranks)
    got = _bars(ax)
    return len(got) == len(want) and all(
        g == pytest.approx(w, abs=2e-6) for g, w in zip(got, want))


def _bar_count(ax) -> int:
    """Bars of a timeline panel (one per task and rank, gathered into collections)."""
    return sum(len(c.get_paths()) for c in ax.collections)


def test_the_timeline_panels_draw_every_task_on_its_ranks(tool, tmp_path):
    """By default the first row with a timeline and the slowest: one bar per task and rank, at
    the task's predicted start for its duration, hatched where it recomputes."""
    log = tmp_path / "run.jsonl"
    plans = write_run_log(log, timeline_interval=5)  # timelines at 1, 5, 10, 15, 20
    rows = tool.read_log(str(log))
    slowest = max((r for r in rows if "timeline" in r), key=lambda r: r["step_s"])["iteration"]
    assert slowest not in (1,) and tool.default_timeline(rows) == [1, slowest]
    fig = tool.draw(rows)
    panels = [ax for ax in fig.axes if ax.get_title().startswith("timeline of iteration ")]
    assert [ax.get_title().split(":")[0] for ax in panels] == [
        "timeline of iteration 1", f"timeline of iteration {slowest}"]
    for ax, it in zip(panels, (1, slowest)):
        plan = plans[it - 1]
        assert _bar_count(ax) == sum(t.degree for t in plan.tasks)
        assert _same_bars(ax, plan)
        assert not _same_bars(ax, plans[it % 20])  # negative control: another step's plan
        hatched = sum(len(c.get_paths()) for c in ax.collections if c.get_hatch())
        assert hatched == sum(t.degree for t in plan.tasks if t.recompute_layers)
        assert ax.get_ylim() == (7.5, -0.5)  # 8 ranks, rank 0 at the top
    assert panels[-1].get_legend() is not None
    matplotlib.pyplot.close(fig)


def test_timeline_flag_chooses_the_iterations(tool, tmp_path):
    log = tmp_path / "run.jsonl"
    plans = write_run_log(log, iterations=6, timeline_interval=2)  # timelines at 1, 2, 4, 6
    rows = tool.read_log(str(log))
    fig = tool.draw(rows, timeline=[4, 3, 9])
    panels = [ax for ax in fig.axes if ax.get_title().startswith("timeline of iteration ")]
    assert [ax.get_title().split(":")[0] for ax in panels] == [
        f"timeline of iteration {i}" for i in (4, 3, 9)]
    assert _bar_count(panels[0]) == sum(t.degree for t in plans[3].tasks)
    assert [t.get_text() for t in panels[1].texts] == ["no timeline of iteration 3 in this log"]
    assert [t.get_text() for t in panels[2].texts] == ["no row of iteration 9 in this log"]
    matplotlib.pyplot.close(fig)
    assert tool.main([str(log), "--timeline", "2,4", "--dpi", "30"]) == 0
    with pytest.raises(SystemExit):
        tool.main([str(log), "--timeline", "two"])


def test_simulate_plot_draws_through_the_shared_function(tmp_path, monkeypatch, capsys):
    """``dcp-simulate --plot`` draws each plan with `timeline_plot.draw_timeline`, the function
    dcp-report draws with, given the plan's tasks at their simulated times."""
    from tools import report, simulate, timeline_plot

    assert simulate.draw_timeline is report.draw_timeline is timeline_plot.draw_timeline
    calls = []

    def recorded(ax, tasks, colours, world_size):
        calls.append((ax, list(tasks), world_size))
        timeline_plot.draw_timeline(ax, calls[-1][1], colours, world_size)

    monkeypatch.setattr(simulate, "draw_timeline", recorded)
    shown = {}
    real_plot = simulate.plot_plans
    monkeypatch.setattr(simulate, "plot_plans",
                        lambda s, path, cm: (shown.update({n: (p, r) for n, p, r in s}),
                                             real_plot(s, path, cm)))
    png = tmp_path / "t.png"
    assert simulate.main(["--gpus", "8", "--policy", "dcp,bucket", "--global-batch-tokens",
                          "200000", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [len(tasks) for _, tasks, _ in calls] == [out["policies"][n]["tasks"]
                                                     for n in ("dcp", "bucket")]
    for (ax, tasks, world), name in zip(calls, ("dcp", "bucket")):
        plan, result = shown[name]
        assert world == 8 and [t[:2] for t in tasks] == list(zip(result.starts,
                                                                  result.durations))
        assert [(t[2], t[3], tuple(t[4])) for t in tasks] == [
            (t.degree, t.recompute_layers, t.ranks) for t in plan.tasks]
        assert _bar_count(ax) == sum(t.degree for t in plan.tasks)


def test_rows_of_the_megatron_launcher_and_older_logs(tool, tmp_path):
    """The launcher's rows (loss, tokens, plan) and rows written before figures: the panels
    they have figures for are drawn, the others say so."""
    log = tmp_path / "launcher.jsonl"
    rows = [{"iteration": i, "loss": 5.0 - i / 10, "tokens": 4000, "sequences": 3,
             "plan": {"mode": "dcp", "degrees": {"1": 3, "2": 1},
                      "micro_steps_per_rank": [3, 1], "recompute_layers": [0, 1],
                      "predicted_s": 0.2}} for i in range(1, 6)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = tool.draw(tool.read_log(str(log)))
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert axes["loss"].get_lines() and axes["degree mix"].collections
    assert axes["degree mix"].get_ylabel() == "tasks"
    assert [t.get_text() for t in axes["tokens/s and MFU"].texts] == [
        "no tokens/s trained / tokens/s run in this log"]
    assert [t.get_text() for t in axes["timeline"].texts] == [
        "no timeline (rows carry one every --log-timeline-interval iterations) in this log"]
    assert not axes["timeline"].collections
    matplotlib.pyplot.close(fig)
    assert tool.main([str(log), "--out", str(tmp_path / "out" / "r")]) == 0
    assert (tmp_path / "out" / "r.png").exists() and (tmp_path / "out" / "r.html").exists()


def test_tokens_trained_and_run_are_apart(tool, tmp_path):
    """A loss mask trains fewer tokens than the step runs: the throughput panel draws both
    rates under their own names and the page's totals give both counts."""
    rows = [{"iteration": i, "loss": 2.0, "tokens": 300, "tokens_run": 1000, "step_s": 2.0,
             "tokens_per_s": 150.0, "tokens_run_per_s": 500.0, "plan": {"mode": "dcp"}}
            for i in (1, 2)]
    log = tmp_path / "masked.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = tool.draw(tool.read_log(str(log)))
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    lines = {line.get_label(): list(line.get_ydata())
             for line in axes["tokens/s and MFU"].get_lines()}
    assert lines == {"tokens/s trained": [150.0, 150.0], "tokens/s run": [500.0, 500.0]}
    matplotlib.pyplot.close(fig)
    got = tool.totals(tool.read_log(str(log)))
    assert (got["tokens trained"], got["tokens run"]) == ("600", "2000")
    assert (got["tokens/s trained"], got["tokens/s run"]) == ("150.0", "500.0")


@pytest.mark.parametrize("second_line", ['{"epoch": 1, "acc": 0.5}', "not json",
                                         '{"iteration": 2, "loss": 1.0}'])
def test_a_non_dcp_file_is_refused_naming_the_line(tool, tmp_path, capsys, second_line):
    log = tmp_path / "other.jsonl"
    first = {"iteration": 1, "loss": 1.0, "plan": {"mode": "data-parallel"}}
    log.write_text(json.dumps(first) + "\n" + second_line + "\n")
    assert tool.main([str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {log}:2: not") and err.count("\n") == 1
    assert not (tmp_path / "other.png").exists()


def test_without_matplotlib_it_says_how_to_install_it(tool, tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert tool.main([str(tmp_path / "run.jsonl")]) == 2
    assert "pip install 'megatron-dcp[plot]'" in capsys.readouterr().err


# ---------------------------------------------------------------- issue 59: outputs and inputs

_ROW = {"iteration": 1, "loss": 1.0, "tokens": 10, "step_s": 0.5, "plan": {"mode": "dcp"},
        "timeline": {"world_size": 2, "tasks": [[0.0, 0.1, 2, 0, 0]]}}


def _log(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in (rows or (_ROW,))))
    return path


def _refused(tool, argv, capsys) -> str:
    """The one-line error of a run refused while parsing (argparse's status 2)."""
    with pytest.raises(SystemExit) as stop:
        tool.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_a_log_named_html_is_not_replaced_by_its_report(tool, tmp_path, capsys):
    log = _log(tmp_path / "run.html")
    before = log.read_bytes()
    line = _refused(tool, [str(log)], capsys)
    assert "the report would be written over the log itself" in line and "--out" in line
    assert log.read_bytes() == before and not (tmp_path / "run.png").exists()
    # an explicit --out naming the log is refused the same way, also with --overwrite
    line = _refused(tool, [str(log), "--out", str(tmp_path / "run"), "--overwrite"], capsys)
    assert f"is the input log {log}" in line and log.read_bytes() == before


def test_out_never_replaces_a_file_it_did_not_write(tool, tmp_path, capsys):
    log = _log(tmp_path / "run.jsonl")
    notes = tmp_path / "notes.html"
    notes.write_text("my notes")
    line = _refused(tool, [str(log), "--out", str(tmp_path / "notes")], capsys)
    assert line.endswith(f"--out {notes} already exists and was not written by dcp-report: add "
                         "--overwrite to replace it, or give another path")
    assert notes.read_text() == "my notes" and not (tmp_path / "notes.png").exists()
    assert tool.main([str(log), "--out", str(tmp_path / "notes"), "--overwrite",
                      "--dpi", "20"]) == 0
    assert 'content="dcp-report (megatron-dcp)"' in notes.read_text()
    # its own outputs: a second report replaces them without --overwrite
    assert tool.main([str(log), "--out", str(tmp_path / "notes"), "--dpi", "20"]) == 0


def test_out_takes_a_stem_or_a_file_with_its_suffix(tool, tmp_path, capsys):
    log = _log(tmp_path / "run.jsonl")
    assert tool.main([str(log), "--out", str(tmp_path / "x.png"), "--dpi", "20"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.jsonl", "x.html", "x.png"]
    assert tool.main([str(log), "--out", str(tmp_path / "y.html"), "--dpi", "20"]) == 0
    assert (tmp_path / "y.png").exists() and (tmp_path / "y.html").exists()
    line = _refused(tool, [str(log), "--out", str(tmp_path / "d") + "/"], capsys)
    assert "--out" in line and "is a folder or empty: give a stem such as" in line
    assert not (tmp_path / "d").exists()


def test_dpi_is_bounded(tool, tmp_path, capsys):
    log = _log(tmp_path / "run.jsonl")
    for dpi in ("0", "-3", "100000"):
        assert "argument --dpi" in _refused(tool, [str(log), "--dpi", dpi], capsys)


def _task(**change):
    return {**_ROW, "timeline": {**_ROW["timeline"], **change}}


@pytest.mark.parametrize("line, message", [
    (json.dumps({**_ROW, "step_s": "fast"}), 'step_s "fast" is not a number'),
    (json.dumps(_task(tasks=[[0, 0.1, 2, 0]])), "timeline task 0: [0, 0.1, 2, 0] is not"),
    (json.dumps(_task(tasks=[[0, 0.1, 10**9, 0, 0]])),
     "timeline task 0: degree 1000000000 is not a whole number from 1 to the world's 2 ranks"),
    (json.dumps(_task(tasks=[[0, 0.1, 200000, 0, list(range(200000))]])),
     "timeline task 0: degree 200000"),
    (json.dumps(_task(tasks=[[0, 0.1, 2, 0, [0, 7]]])), "are not 2 distinct ranks"),
    (json.dumps(_task(tasks=[[0, 0.1, 2, 0, 1]])), "ranks 1..2 lie outside"),
    (json.dumps(_task(world_size=10**9)), "timeline world_size 1000000000"),
    (json.dumps({**_ROW, "plan": {"mode": "dcp", "degrees": {"2": "x"}}}),
     'plan degrees 2: "x" is not a count'),
    (json.dumps({**_ROW, "plan": {"mode": "dcp", "micro_steps_per_rank": 5}}),
     "plan micro_steps_per_rank is a int, not a list"),
    ("[" * 100000 + "]" * 100000, "JSON nested too deeply"),
])
def test_a_malformed_row_is_refused_naming_its_line(tool, tmp_path, capsys, line, message):
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps(_ROW) + "\n" + line + "\n")
    assert tool.main([str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {log}:2: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run.png").exists()


def test_a_line_that_is_not_utf8_is_named(tool, tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    log.write_bytes(json.dumps(_ROW).encode() + b'\n{"iteration": 2, "x": "\xe9"}\n')
    assert tool.main([str(log)]) == 2
    assert capsys.readouterr().err == (f"error: {log}:2: not UTF-8 text (byte 0xe9 at column "
                                       "24); a log written by --log-json is UTF-8\n")


def test_a_timeline_too_large_to_draw_says_so_at_once(tool, tmp_path):
    """A valid timeline of 1,048,576 ranks (a crafted or a real one): counted before any rank
    is spelled out, and the panel says it holds more bars than it draws."""
    import time

    world = 1 << 20
    row = _task(world_size=world, tasks=[[0.0, 0.1, world, 0, 0]] * 3)
    t0 = time.perf_counter()
    fig = tool.draw(tool.read_log(str(_log(tmp_path / "big.jsonl", row))))
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("timeline of iteration 1"))
    assert [t.get_text() for t in panel.texts] == [
        "3,145,728 bars (tasks x ranks): more than the 50,000 a panel draws"]
    assert not panel.collections and time.perf_counter() - t0 < 30
    matplotlib.pyplot.close(fig)
