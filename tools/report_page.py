"""``dcp-report``'s HTML page: one self-contained file (inline SVG charts, a small script, the
PNG embedded; nothing fetched from a network), a panel per `PAGE_PANELS` entry.

Every chart zooms (mouse wheel, around the pointer), pans (drag) and resets (double click); the
value under the pointer is shown in the panel's readout (`SCRIPT`). When the script has set up
every chart it writes ``data-report-ready="N"`` (N charts) on ``<body>``: a test in a headless
browser reads that marker back. A panel whose figures a log lacks says so in words.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_dcp.runtime.figures import row_figures
from megatron_dcp.runtime.report import timeline_bars, timeline_tasks

if __package__:
    from .report_svg import bar_chart, line_chart, number, timeline_chart
else:
    from report_svg import bar_chart, line_chart, number, timeline_chart

PAGE_PANELS = ("run configuration", "loss", "tokens/s and MFU", "tokens/s and TFLOP/s per rank",
               "memory per rank", "grad norm and learning rate",
               "planning time and calibration error", "step time: predicted vs measured",
               "degree mix", "recompute and micro-steps", "idle share and plan efficiency",
               "timeline: predicted vs measured")
"""Every panel of the page, in order; each is a ``<section id="panel-...">`` (`panel_id`)."""

MAX_PAGE_BARS = 20_000
"""The most task bars (per rank, predicted and measured) a timeline chart holds on the page."""


def panel_id(name: str) -> str:
    """``panel-tokens-s-and-mfu`` of ``tokens/s and MFU``."""
    return "panel-" + "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def _series(rows, figs, name: str, label: str, scale: float = 1.0):
    pairs = [(int(r["iteration"]), f[name] * scale) for r, f in zip(rows, figs) if name in f]
    return (label, [p[0] for p in pairs], [p[1] for p in pairs]) if pairs else None


def _row_series(rows, key: str, label: str):
    pairs = [(int(r["iteration"]), float(r[key])) for r in rows
             if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return (label, [p[0] for p in pairs], [p[1] for p in pairs]) if pairs else None


def _missing(what: str) -> str:
    return f'<p class="missing">no {html.escape(what)} in this log</p>'


def _lines(name: str, left: list, ylabel: str, missing: str, right: Sequence = (),
           right_label: str = "", dashed: Sequence[str] = ()) -> str:
    left, right = [s for s in left if s], [s for s in right if s]
    if not left and not right:
        return _missing(missing)
    if not left:
        left, right, ylabel = right, [], right_label
    return line_chart(name, left, ylabel=ylabel, right=right, right_label=right_label,
                      dashed=dashed)


def run_configuration(rows: Sequence[dict[str, Any]], summary: dict[str, str]) -> str:
    """The ``run`` object of the first row that has one (model, layout, flags, commit: written
    by both front ends since issue 60) and the run's totals, as tables."""
    run = next((r["run"] for r in rows if isinstance(r.get("run"), dict)), None)
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                    for k, v in summary.items())
    out = f'<table class="totals">{cells}</table>'
    if run is None:
        return out + _missing("run configuration (model, layout, flags, commit: rows written "
                              "before it was logged)")
    items = []
    for key, value in run.items():
        text = value if isinstance(value, str) else json.dumps(value) if not isinstance(
            value, list) else " ".join(map(str, value))
        if isinstance(value, dict):
            text = ", ".join(f"{k} {v}" for k, v in value.items())
        items.append(f"<tr><th>{html.escape(str(key))}</th><td>{html.escape(str(text))}</td>"
                     "</tr>")
    return out + f'<table class="config">{"".join(items)}</table>'


def _last_ranks(rows) -> Optional[dict[str, Any]]:
    """The last row whose timeline carries per-rank figures."""
    return next((r for r in reversed(rows) if isinstance(r.get("timeline"), dict)
                 and isinstance(r["timeline"].get("ranks"), dict)), None)


def per_rank(rows) -> str:
    """Tokens/s and TFLOP/s per GPU of each DCP rank at the last row carrying them."""
    row = _last_ranks(rows)
    ranks = row["timeline"]["ranks"] if row else {}
    step = float(row.get("step_s") or 0) if row else 0.0
    if not row or "tokens" not in ranks or step <= 0:
        return _missing("per-rank tokens (rows carry them with the timeline, every "
                        "--log-timeline-interval iterations)")
    out = [f'<p class="caption">iteration {row["iteration"]}, step {number(step)} s: tokens '
           "each rank ran (its share of each task's sequences) over the step time</p>",
           bar_chart("tokens/s per rank", [("tokens/s", [float(v or 0) / step
                                                         for v in ranks["tokens"]])],
                     ylabel="tokens/s")]
    if "tflop" in ranks:
        gpus = float(ranks.get("gpus_per_rank") and ranks["gpus_per_rank"][0] or 1)
        out.append(bar_chart("TFLOP/s per rank", [("TFLOP/s per GPU", [
            float(v or 0) / step / gpus for v in ranks["tflop"]])], ylabel="TFLOP/s per GPU"))
    return "".join(out)


def memory(rows) -> str:
    """Peak memory per GPU of the job (the last row carrying it) and the writing rank's peak
    over the iterations."""
    out = []
    row = _last_ranks(rows)
    mem = row["timeline"]["ranks"].get("peak_mem_mb") if row else None
    if mem:
        out.append(f'<p class="caption">iteration {row["iteration"]}: peak memory of every '
                   "process of the job, MiB</p>")
        out.append(bar_chart("peak memory per rank", [("peak MiB", [float(v or 0)
                                                                    for v in mem])],
                             ylabel="MiB", xlabel="rank of the job"))
    line = _row_series(rows, "peak_mem_mb", "peak MiB (writing rank)")
    if line:
        out.append(line_chart("peak memory over iterations", [line], ylabel="MiB"))
    return "".join(out) or _missing("peak memory (peak_mem_mb)")


def _measured_bars(tasks, measured) -> tuple[list, float]:
    """The measured tasks replayed in the plan's order: a task starts when every rank of its
    group is free (as the ranks run it), lasts its measured seconds; returns (bars, end)."""
    free: dict[int, float] = {}
    bars, end = [], 0.0
    order = sorted(range(len(tasks)), key=lambda k: (tasks[k][0], k))
    for k in order:
        start, _, degree, recompute, ranks = tasks[k]
        seconds = measured[k]
        if seconds is None:
            continue
        begin = max(free.get(r, 0.0) for r in ranks)
        for r in ranks:
            free[r] = begin + seconds
            bars.append((r, begin, seconds, degree, recompute, "measured"))
        end = max(end, begin + seconds)
    return bars, end


def timelines(rows, chosen: Sequence[int]) -> str:
    """The predicted timeline of each ``chosen`` iteration with, where the row carries
    ``measured_s``, the measured task times beside it and what the step spent outside them."""
    by_iteration = {int(r["iteration"]): r for r in rows}
    if not chosen:
        return _missing("timeline (rows carry one every --log-timeline-interval iterations)")
    out = []
    for it in chosen:
        row = by_iteration.get(it)
        if row is None or not isinstance(row.get("timeline"), dict):
            out.append(_missing(f"{'row' if row is None else 'timeline'} of iteration {it}"))
            continue
        timeline = row["timeline"]
        if 2 * timeline_bars(timeline) > MAX_PAGE_BARS:
            out.append(f'<p class="missing">timeline of iteration {it}: too many task bars to '
                       f"draw ({timeline_bars(timeline):,} per lane)</p>")
            continue
        tasks = timeline_tasks(timeline)
        bars = [(r, s, d, deg, rec, "predicted") for s, d, deg, rec, ranks in tasks
                for r in ranks]
        makespan = max([s + d for s, d, *_ in tasks] + [0.0])
        marks = [("plan makespan", makespan)]
        words = [f"plan makespan {number(makespan)} s"]
        end = None
        if isinstance(timeline.get("measured_s"), list):
            measured, end = _measured_bars(tasks, timeline["measured_s"])
            bars += measured
            marks.append(("measured tasks (replayed in plan order)", end))
            words.append(f"measured tasks {number(end)} s")
        else:
            words.append("no measured task times (calibration off, or an older log)")
        for label, key in (("predicted step", "predicted_s"), ("measured step", "step_s")):
            if isinstance(row.get(key), (int, float)):
                marks.append((label, float(row[key])))
                words.append(f"{label} {number(float(row[key]))} s")
        if isinstance(row.get("step_s"), (int, float)) and end is not None:
            words.append(f"outside the tasks {number(float(row['step_s']) - end)} s "
                         "(data, gradient reduction, optimizer step, waiting)")
        out.append(f'<p class="caption">iteration {it}: {html.escape(", ".join(words))}; '
                   "upper half of a rank: predicted, lower half: measured</p>")
        out.append(timeline_chart(f"timeline of iteration {it}", bars,
                                  int(timeline["world_size"]), marks))
    return "".join(out)


def panels(rows, baseline=None, chosen: Sequence[int] = (), summary=None) -> dict[str, str]:
    """The HTML of every `PAGE_PANELS` entry."""
    figs = [row_figures(r) for r in rows]
    base = baseline or []
    bfigs = [row_figures(r) for r in base]
    dashed = ("baseline loss", "baseline tokens/s")
    degrees = sorted({k for f in figs for k in f if k.startswith(("tokens_degree_",
                                                                  "tasks_degree_"))},
                     key=lambda k: int(k.rsplit("_", 1)[1]))
    return {
        "run configuration": run_configuration(rows, summary or {}),
        "loss": _lines("loss", [_series(rows, figs, "loss", "loss"),
                                _series(base, bfigs, "loss", "baseline loss")], "loss",
                       "loss", dashed=dashed),
        "tokens/s and MFU": _lines(
            "tokens/s and MFU", [_series(rows, figs, "tokens_per_s", "tokens/s trained"),
                                 _series(rows, figs, "tokens_run_per_s", "tokens/s run"),
                                 _series(base, bfigs, "tokens_per_s", "baseline tokens/s")],
            "tokens/s", "tokens/s", right=[_series(rows, figs, "mfu", "MFU %", 100.0)],
            right_label="MFU %", dashed=dashed),
        "tokens/s and TFLOP/s per rank": per_rank(rows),
        "memory per rank": memory(rows),
        "grad norm and learning rate": _lines(
            "grad norm and learning rate", [_series(rows, figs, "grad_norm", "grad norm")],
            "grad norm", "grad norm / learning rate", right=[_row_series(rows, "lr",
                                                                         "learning rate")],
            right_label="learning rate"),
        "planning time and calibration error": _lines(
            "planning time and calibration error",
            [_series(rows, figs, "plan_ms", "planning ms"),
             _series(rows, figs, "plan_wait_ms", "waited for the plan, ms")], "ms",
            "planning time / calibration error",
            right=[_series(rows, figs, "calibration_error", "calibration error %", 100.0),
                   _series(rows, figs, "prediction_error", "this step's error %", 100.0)],
            right_label="error %"),
        "step time: predicted vs measured": _lines(
            "step time", [_series(rows, figs, "step_s", "measured"),
                          _series(rows, figs, "predicted_s", "predicted")], "seconds",
            "step_s / predicted_s"),
        "degree mix": _lines("degree mix", [_series(rows, figs, k, "degree " + k.rsplit(
            "_", 1)[1]) for k in degrees], degrees[0].split("_")[0] if degrees else "",
            "degrees"),
        "recompute and micro-steps": _lines("recompute and micro-steps", [
            _series(rows, figs, k, label) for k, label in (
                ("recompute_layers_mean", "recomputed layers (mean)"),
                ("recompute_layers_max", "recomputed layers (max)"),
                ("micro_steps_min", "micro-steps (min rank)"),
                ("micro_steps_max", "micro-steps (max rank)"))], "count",
            "recomputed layers / micro-steps"),
        "idle share and plan efficiency": _lines("idle share and plan efficiency", [
            _series(rows, figs, "idle_share", "idle share"),
            _series(rows, figs, "plan_efficiency", "efficiency vs lower bound")], "share",
            "idle share / plan efficiency"),
        "timeline: predicted vs measured": timelines(rows, chosen),
    }


STYLE = """body{font-family:sans-serif;margin:1em;background:#fff;color:#222}
.grid-panels{display:grid;grid-template-columns:repeat(auto-fill,minmax(620px,1fr));gap:1em}
.panel{border:1px solid #ddd;border-radius:4px;padding:.5em}.panel h2{font-size:1.05em;margin:0}
.panel.wide{grid-column:1/-1}svg.chart{width:100%;height:auto;cursor:crosshair;user-select:none}
.axis{stroke:#444}.grid{stroke:#eee}.tick,.legend,.label{font-size:11px;fill:#333}
.missing{color:grey}.caption{font-size:.85em;color:#444;margin:.2em 0}
.readout{font-size:.85em;color:#036;min-height:1.2em}table{border-collapse:collapse;margin:.3em 0}
th,td{text-align:left;padding:1px 8px;font-size:.9em;vertical-align:top}th{color:#555}
"""

SCRIPT = """(function(){
var charts=document.querySelectorAll('svg.chart');
charts.forEach(function(svg){
  var box=svg.viewBox.baseVal, home=[box.x,box.y,box.width,box.height], drag=null;
  var out=svg.closest('.panel').querySelector('.readout');
  function point(e){var r=svg.getBoundingClientRect();
    return [box.x+(e.clientX-r.left)/r.width*box.width,
            box.y+(e.clientY-r.top)/r.height*box.height];}
  svg.addEventListener('wheel',function(e){e.preventDefault();
    var p=point(e), f=e.deltaY<0?0.8:1.25;
    var w=Math.min(box.width*f,home[2]), h=Math.min(box.height*f,home[3]);
    box.x=p[0]-(p[0]-box.x)*w/box.width; box.y=p[1]-(p[1]-box.y)*h/box.height;
    box.width=w; box.height=h;},{passive:false});
  svg.addEventListener('mousedown',function(e){drag=point(e);});
  window.addEventListener('mouseup',function(){drag=null;});
  svg.addEventListener('mousemove',function(e){
    if(drag){var p=point(e); box.x+=drag[0]-p[0]; box.y+=drag[1]-p[1];}
    var t=e.target.querySelector&&e.target.querySelector('title');
    if(t&&out&&e.target!==svg){out.textContent=t.textContent;}});
  svg.addEventListener('dblclick',function(){
    box.x=home[0]; box.y=home[1]; box.width=home[2]; box.height=home[3];});
});
document.body.setAttribute('data-report-ready', String(charts.length));
})();"""


def write_page(path: str, title: str, sections: dict[str, str], png_path: str,
               generator: str) -> None:
    """The page: a section per panel (a readout line under each), then the PNG (base64)."""
    data = base64.b64encode(Path(png_path).read_bytes()).decode("ascii")
    body = []
    for name in PAGE_PANELS:
        wide = " wide" if name in ("run configuration", "timeline: predicted vs measured") else ""
        body.append(f'<section class="panel{wide}" id="{panel_id(name)}"><h2>'
                    f'{html.escape(name)}</h2>{sections[name]}<div class="readout"></div>'
                    "</section>")
    Path(path).write_text(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<meta name=\"generator\" content=\"{html.escape(generator)}\">"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
        f"<h1 style=\"font-size:1.3em\">{html.escape(title)}</h1>"
        "<p class=\"caption\">Charts zoom with the mouse wheel, pan by dragging, reset with a "
        "double click; the value under the pointer shows below each chart.</p>\n"
        f"<div class=\"grid-panels\">{''.join(body)}</div>\n"
        "<details><summary>the same report as one image (PNG)</summary>"
        f"<img id=\"report\" alt=\"{html.escape(title)}\" style=\"display:block;width:100%\" "
        f"src=\"data:image/png;base64,{data}\"></details>\n"
        f"<script>{SCRIPT}</script>\n</body></html>\n")
