"""``dcp-report``'s page (issue 60): every panel in a real headless browser without a script
error, the run's configuration, per-rank and measured-task figures read from the rows both front
ends write (`assert_report_fields`, used by the engines' end-to-end tests), a plain run's log
drawn over the run's (``--baseline``: a --log-json or Megatron-LM's console log), and a
Megatron-LM console log given as the run's log named as one."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest


def assert_report_fields(rows: list, *, engine: str) -> None:
    """What the page reads beyond the figures: the run's configuration in the first row only,
    the learning rate in every row, and beside the first row's timeline each task's measured
    seconds and per-rank tokens run, TFLOP and the peak memory of both processes."""
    run = rows[0]["run"]
    assert run["engine"] == engine and run["model"]["layers"] >= 1 and run["layout"]["ranks"] == 2
    assert run["command"] and "commit" in run and "run" not in rows[1]
    assert all(isinstance(r["lr"], float) and r["lr"] > 0 for r in rows)
    timeline = rows[0]["timeline"]
    assert len(timeline["measured_s"]) == len(timeline["tasks"])
    assert all(v is None or v > 0 for v in timeline["measured_s"])
    ranks = timeline["ranks"]
    assert len(ranks["peak_mem_mb"]) == 2 and min(ranks["peak_mem_mb"]) > 0
    figures = rows[0]["figures"]
    run_tokens = figures.get("tokens_run", sum(v for k, v in figures.items()
                                                 if k.startswith("tokens_degree_")))
    assert sum(ranks["tokens"]) == pytest.approx(run_tokens, rel=1e-3)
    assert sum(ranks["tflop"]) == pytest.approx(figures["model_tflop"], rel=1e-2)


@pytest.fixture
def tool(tools_on_path):
    pytest.importorskip("matplotlib")
    import report

    return report


def full_log(path: Path, iterations: int = 6) -> Path:
    """A --log-json as both front ends now write it (`write_run_log`'s rows, 8 ranks), with the
    run's configuration, learning rate, peak memory and, beside each timeline, measured task
    seconds and per-rank figures."""
    from test_report_tool import write_run_log

    write_run_log(path, iterations=iterations, timeline_interval=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r.update(lr=1e-4 * r["iteration"], peak_mem_mb=1200.0 + r["iteration"])
        if "timeline" in r:
            tasks = r["timeline"]["tasks"]
            r["timeline"]["measured_s"] = [t[1] * 1.25 for t in tasks]
            r["timeline"]["ranks"] = {"tokens": [100.0 * (k + 1) for k in range(8)],
                                      "tflop": [0.5] * 8, "gpus_per_rank": [1],
                                      "peak_mem_mb": [2000.0 + k for k in range(8)]}
    rows[0]["run"] = {"engine": "megatron-lm", "model": {"layers": 24, "hidden": 2048},
                      "layout": {"ranks": 8, "tensor": 1}, "command": "pretrain_gpt.py --dcp",
                      "commit": "0123456789ab"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chromium() -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium (Debian's package; .ci/run installs it where apt-get can)")
    return browser


def _load(browser: str, page: Path) -> tuple[str, list[str]]:
    """(the DOM after the page's scripts ran, the console's error lines) of headless
    Chromium loading ``page``."""
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           "--enable-logging=stderr", "--v=0", "--window-size=1400,2000",
                           "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines()
              if "CONSOLE" in line and re.search(r"Uncaught|Error", line)]
    return done.stdout, errors


@pytest.mark.slow  # launches a browser
def test_every_panel_in_a_browser_without_errors(tool, tmp_path):
    """Headless Chromium runs the page's script to its end (its marker counts every chart)
    with no console error, and every panel the issue names holds a chart, none saying its
    figures are missing; the same page with its script broken fails both checks."""
    import report_page

    browser = _chromium()
    log = full_log(tmp_path / "run.jsonl")
    base = tmp_path / "plain.jsonl"
    base.write_text("".join(json.dumps({"iteration": i, "loss": 9.0 / i, "tokens": 4000,
                                        "tokens_per_s": 3000.0 + i, "step_s": 1.3,
                                        "plan": {"mode": "data-parallel"}}) + "\n"
                            for i in range(1, 7)))
    assert tool.main([str(log), "--dpi", "30", "--baseline", str(base)]) == 0
    page = tmp_path / "run.html"
    text = page.read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in text  # offline: nothing fetched
    dom, errors = _load(browser, page)
    assert errors == []
    charts = dom.count('<svg class="chart"')
    assert charts >= 14 and re.search(f'<body[^>]* data-report-ready="{charts}"', dom)
    for name in report_page.PAGE_PANELS:
        section = re.search(f'<section class="panel[^"]*" id="{report_page.panel_id(name)}">'
                            r"(.*?)</section>", dom, re.S)
        assert section, name
        assert 'class="missing"' not in section.group(1), (name, section.group(1)[:300])
        assert name == "run configuration" or "<svg" in section.group(1), name
    for what in ("0123456789ab", "pretrain_gpt.py --dcp", "layers 24, hidden 2048",
                 'data-series="baseline loss"', 'data-series="baseline tokens/s"',
                 'data-series="learning rate"', 'data-series="calibration error %"',
                 'class="task measured"', "outside the tasks", "TFLOP/s per GPU"):
        assert what in dom, what
    broken = tmp_path / "broken.html"
    broken.write_text(text.replace("var charts=", "var charts=undefinedName+"))
    dom, errors = _load(browser, broken)
    assert not re.search("<body[^>]* data-report-ready", dom) and errors


def test_an_older_log_says_what_it_lacks(tool, tmp_path):
    """Rows written before issue 60 (no run, lr, measured or per-rank figures): the page is
    written, and those panels say what the log lacks."""
    from test_report_tool import write_run_log

    import report_page

    log = tmp_path / "old.jsonl"
    write_run_log(log, iterations=4, timeline_interval=2)
    assert tool.main([str(log), "--dpi", "30"]) == 0
    text = (tmp_path / "old.html").read_text()
    sections = dict(re.findall(r'<section class="panel[^"]*" id="([^"]+)">(.*?)</section>',
                               text, re.S))
    lacking = {report_page.panel_id(n) for n in ("run configuration",
                                                  "tokens/s and TFLOP/s per rank",
                                                  "memory per rank")}
    for key in lacking:
        assert 'class="missing"' in sections[key], key
    assert "no measured task times" in sections["panel-timeline-predicted-vs-measured"]
    assert 'data-series="learning rate"' not in sections["panel-grad-norm-and-learning-rate"]


MEGATRON_TEXT = """using world size: 2, data-parallel size: 2, context-parallel size: 1
------------------------ arguments ------------------------
  seq_length ...................................... 1024
  global_batch_size ............................... 8
 [2026-12-07 10:00:01.000000] iteration        1/      10 | consumed samples:            8 | \
elapsed time per iteration (ms): 2048.0 | throughput per GPU (TFLOP/s/GPU): 3.5 | learning \
rate: 1.000000E-04 | global batch size:     8 | lm loss: 1.040000E+01 | loss scale: 1.0 | \
grad norm: 3.250 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-12-07 10:00:03.000000] iteration        2/      10 | consumed samples:           16 | \
elapsed time per iteration (ms): 1024.0 | learning rate: 2.000000E-04 | global batch size: \
    8 | lm loss: 9.500000E+00 | loss scale: 1.0 | number of skipped iterations:   0 |
"""


def test_a_megatron_text_log_is_named_with_the_flag_that_writes_rows(tool, tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(MEGATRON_TEXT)
    assert tool.main([str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {log}:1: not JSON: it looks like Megatron-LM's console log")
    assert "--dcp-log-json PATH" in err and err.count("\n") == 1
    assert not (tmp_path / "train.png").exists()


def test_a_megatron_text_log_as_baseline(tool, tmp_path):
    """Megatron-LM's console log as ``--baseline``: its loss, and tokens/s from its own count
    (global batch size x seq_length over the elapsed time)."""
    from report_logs import read_baseline

    log = tmp_path / "plain.log"
    log.write_text(MEGATRON_TEXT)
    rows = read_baseline(str(log))
    assert [(r["iteration"], r["loss"], r["tokens"], r["tokens_per_s"]) for r in rows] == [
        (1, 10.4, 8192, 4000.0), (2, 9.5, 8192, 8000.0)]
    assert rows[0]["grad_norm"] == 3.25 and rows[0]["lr"] == 1e-4 and "grad_norm" not in rows[1]
    run = full_log(tmp_path / "run.jsonl", iterations=3)
    assert tool.main([str(run), "--dpi", "30", "--baseline", str(log)]) == 0
    assert 'data-series="baseline loss"' in (tmp_path / "run.html").read_text()


def test_a_baseline_that_is_neither_is_refused(tool, tmp_path, capsys):
    run = full_log(tmp_path / "run.jsonl", iterations=2)
    other = tmp_path / "notes.txt"
    other.write_text("some notes\n")
    assert tool.main([str(run), "--baseline", str(other)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {other}:1: not JSON")
    with pytest.raises(SystemExit) as stop:
        tool.main([str(run), "--baseline", str(tmp_path / "missing.log")])
    assert stop.value.code == 2
    assert "--baseline" in capsys.readouterr().err


@pytest.mark.slow  # runs git (the commit)
def test_per_rank_work_and_the_timeline_extras_of_a_plan(tmp_path):
    """`rank_work` splits each task's tokens and TFLOP evenly over its ranks (sums: the plan's
    tokens, the figures' model TFLOP); a row carries the extras only beside its timeline, the
    calibration's measured seconds in task order; the commit is this checkout's."""
    from types import SimpleNamespace

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import load_model, make_plan
    from megatron_dcp.runtime.figures import document_flops
    from megatron_dcp.runtime.report import TrainingLog, plan_summary
    from megatron_dcp.runtime.run_info import TimelineExtras, rank_work, source_commit

    shape, config = load_model("gpt-1b"), DCPConfig(enabled=True, hardware="h100")
    lengths = [64 * (k % 9 + 1) for k in range(20)] + [30_000]
    plan = make_plan(lengths, world_size=4, model=shape, config=config, hardware="h100")
    assert any(t.degree > 1 for t in plan.tasks)
    work = rank_work(plan, shape)
    ran = [plan.lengths[s] for t in plan.tasks for s in t.seqs]
    assert sum(work["tokens"]) == pytest.approx(sum(ran), rel=1e-6)
    assert sum(work["tflop"]) == pytest.approx(document_flops(shape, ran) / 1e12, rel=1e-4)
    long_task = next(t for t in plan.tasks if 30_000 in [plan.lengths[s] for s in t.seqs])
    assert all(work["tokens"][r] >= 30_000 / long_task.degree for r in long_task.ranks)
    measured = [0.1 * (k + 1) for k in range(len(plan.tasks))]
    driver = SimpleNamespace(timing=SimpleNamespace(task_seconds=measured), model_shape=shape,
                             hardware=None)
    log = TrainingLog("dcp", 3, json_path=str(tmp_path / "run.jsonl"), quiet=True,
                      timeline_interval=2)
    rows = [log.iteration(it, loss=1.0, tokens=10, step_s=1.0, plan=plan_summary(plan),
                          step_plan=plan,
                          timeline_extra=TimelineExtras(driver, 2).of(plan, [5.0, 6.0]))
            for it in (1, 2, 3)]
    assert ["measured_s" in r.get("timeline", {}) for r in rows] == [True, True, False]
    assert rows[0]["timeline"]["measured_s"] == pytest.approx(measured)
    assert rows[0]["timeline"]["ranks"]["peak_mem_mb"] == [5.0, 6.0]
    assert rows[0]["timeline"]["ranks"]["gpus_per_rank"] == [2]
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent).stdout.strip()
    assert source_commit().split()[0] == head
    assert source_commit(str(tmp_path)) == ""  # not a checkout
