"""``dcp-report RUN.jsonl``: a page (HTML, zoomable) and a picture (PNG) of a training run from
its DCP JSON log.

Reads the rows of ``--log-json`` (the examples) or ``--dcp-log-json`` (the Megatron-LM
launcher) and writes ``RUN.html``, a page a team keeps open (`report_page`: inline SVG charts
that zoom and pan, no network), and ``RUN.png`` (the same run as one image, also embedded in
the page), then prints both paths. The page: the run's configuration (the ``run`` object of its
first row: model, layout, flags, commit) and totals; loss and tokens/s (with a plain run's
drawn over them: ``--baseline LOG``, a --log-json or Megatron-LM's console log) and MFU;
tokens/s and TFLOP/s per rank and memory per rank (carried with the timeline); grad norm and
learning rate; planning time and calibration error; predicted vs measured step time; the mix of
sequence-parallel degrees; recomputed layers and micro-steps; idle share and plan efficiency;
the predicted timeline of chosen iterations beside the measured task times (``measured_s``)
and what the step spent outside its tasks. The PNG's panels are `PANELS`, its last row drawn as
``dcp-simulate --plot`` draws a plan (`timeline_plot`). A panel whose figures a log lacks (an
older log, a run without ``--dcp``) says so instead of a curve.

    dcp-report runs/demo.jsonl                 # runs/demo.png, runs/demo.html
    dcp-report run.jsonl --out report/run      # report/run.png, report/run.html
    dcp-report run.jsonl --timeline 1,500      # the timelines of iterations 1 and 500
    dcp-report run.jsonl --baseline plain.log  # a plain run's loss and tokens/s over the run's

An existing output is replaced only when dcp-report wrote it (or with ``--overwrite``); an
output that would be the log itself (a log named ``run.html``) is refused, before the log is
read. Needs matplotlib (``pip install 'megatron-dcp[plot]'``). Exit status 0, or 2 with a
one-line error naming the file and line of a row that is not a DCP log row (wrong types, a
timeline task outside its world; Megatron-LM's console log is named as one, with the flag that
writes the rows: ``--dcp-log-json``), or the flag of a bad argument.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python tools/report.py` in a checkout
    sys.path.insert(0, str(ROOT))

from megatron_dcp.outputs import (OVERWRITE_HELP, mark, output_problem,  # noqa: E402
                                  same_file)
from megatron_dcp.runtime.figures import row_figures  # noqa: E402
from megatron_dcp.runtime.report import timeline_bars, timeline_tasks  # noqa: E402

if __package__:  # tools.report, megatron_dcp_tools.report
    from .report_logs import LogError, read_baseline, read_log  # noqa: E402
    from .report_page import panels, write_page  # noqa: E402
    from .timeline_plot import (MAX_BARS, crowded_note,  # noqa: E402
                                degree_colours, draw_timeline, legend_handles)
else:  # python tools/report.py (tools/ is first on sys.path)
    from report_logs import LogError, read_baseline, read_log  # noqa: E402
    from report_page import panels, write_page  # noqa: E402
    from timeline_plot import (MAX_BARS, crowded_note,  # noqa: E402
                               degree_colours, draw_timeline, legend_handles)

PANELS = ("loss", "tokens/s and MFU", "step time: predicted vs measured",
          "degree mix", "recompute and micro-steps", "idle share and plan efficiency",
          "timeline")
"""The title of every panel, in drawing order (the last row: a timeline panel per chosen
iteration, titled ``timeline of iteration N ...``)."""

EXTRA_HINT = "pip install 'megatron-dcp[plot]' (or: pip install matplotlib)"


TOOL = "dcp-report"

MAX_DPI = 600
"""The largest ``--dpi``: the figure is 13 x 13 inches, 7800 pixels a side at this one."""


class OutputError(ValueError):
    """An output path that may not be written (`output_paths`): the message names it."""


def _series(iterations: list[int], figures: list[dict[str, float]],
            name: str) -> tuple[list[int], list[float]]:
    pairs = [(i, f[name]) for i, f in zip(iterations, figures) if name in f]
    return [i for i, _ in pairs], [v for _, v in pairs]


def _degree_names(figures: list[dict[str, float]]) -> tuple[str, list[str]]:
    """(``tokens`` or ``tasks``, the figure names of every degree in the log, by degree)."""
    for what in ("tokens", "tasks"):
        names = {k for f in figures for k in f if re.fullmatch(f"{what}_degree_\\d+", k)}
        if names:
            return what, sorted(names, key=lambda k: int(k.rsplit("_", 1)[1]))
    return "tokens", []


def draw(rows: Sequence[dict[str, Any]], title: str = "",
         timeline: Optional[Sequence[int]] = None,
         baseline: Optional[Sequence[dict[str, Any]]] = None):
    """The report's figure (matplotlib ``Figure``): one axes per `PANELS` entry, titled so, the
    last row a timeline panel per iteration of ``timeline`` (default: `default_timeline`);
    ``baseline``'s rows (a plain run) dashed over the loss and tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [int(r["iteration"]) for r in rows]
    figs = [row_figures(r) for r in rows]
    fig = plt.figure(figsize=(13, 13), constrained_layout=True)
    fig.suptitle(title)
    grid = fig.add_gridspec(4, 2, height_ratios=(1, 1, 1, 1.2))
    panels = {name: fig.add_subplot(grid[k // 2, k % 2]) for k, name in enumerate(PANELS[:-1])}
    for name, ax in panels.items():
        ax.set_title(name)
        ax.set_xlabel("iteration")
    _lines(panels["loss"], its, figs, [("loss", "loss")])
    _throughput(panels["tokens/s and MFU"], its, figs)
    _lines(panels["step time: predicted vs measured"], its, figs,
           [("step_s", "measured"), ("predicted_s", "predicted")], ylabel="seconds")
    _degree_mix(panels["degree mix"], its, figs)
    _lines(panels["recompute and micro-steps"], its, figs,
           [("recompute_layers_mean", "recomputed layers (mean)"),
            ("recompute_layers_max", "recomputed layers (max)"),
            ("micro_steps_min", "micro-steps (min rank)"),
            ("micro_steps_max", "micro-steps (max rank)")])
    _lines(panels["idle share and plan efficiency"], its, figs,
           [("idle_share", "idle share"), ("plan_efficiency", "efficiency vs lower bound")])
    _timelines(fig, grid[3, :], rows, default_timeline(rows) if timeline is None else timeline)
    if baseline:
        bits, bfigs = [int(r["iteration"]) for r in baseline], [row_figures(r) for r in baseline]
        for name, key in (("loss", "loss"), ("tokens/s and MFU", "tokens_per_s")):
            x, y = _series(bits, bfigs, key)
            if x:
                panels[name].plot(x, y, linestyle="--", color="grey", label="baseline")
                panels[name].legend(fontsize="small")
    return fig


def default_timeline(rows: Sequence[dict[str, Any]]) -> list[int]:
    """The iterations whose timeline the report draws by default: the first row that carries
    one and the slowest (``step_s``) of those, in iteration order; none without any."""
    carried = [r for r in rows if isinstance(r.get("timeline"), dict)]
    if not carried:
        return []
    slowest = max(carried, key=lambda r: float(r.get("step_s") or 0.0))
    return sorted({int(carried[0]["iteration"]), int(slowest["iteration"])})


def _timelines(fig, cell, rows: Sequence[dict[str, Any]], chosen: Sequence[int]) -> None:
    """The last row: the timeline of every ``chosen`` iteration side by side, one colour per
    degree over all of them; a panel says so where a row carries none."""
    by_iteration = {int(r["iteration"]): r for r in rows}
    axes = cell.subgridspec(1, max(1, len(chosen))).subplots(squeeze=False)[0]
    if not chosen:
        axes[0].set_title(PANELS[-1])
        _missing(axes[0], "timeline (rows carry one every --log-timeline-interval iterations)")
        return
    drawn, crowded = {}, {}
    for it in chosen:
        row = by_iteration.get(it)
        if row is not None and isinstance(row.get("timeline"), dict):
            bars = timeline_bars(row["timeline"])  # counted before a rank is spelled out
            if bars > MAX_BARS:
                crowded[it] = bars
            else:
                drawn[it] = (row, timeline_tasks(row["timeline"]))
    colours = degree_colours(t[2] for _, tasks in drawn.values() for t in tasks)
    end = max([s + d for _, tasks in drawn.values() for s, d, *_ in tasks] + [1e-9])
    for ax, it in zip(axes, chosen):
        if it in crowded:
            ax.set_title(f"{PANELS[-1]} of iteration {it}")
            crowded_note(ax, crowded[it])
            continue
        if it not in drawn:
            ax.set_title(f"{PANELS[-1]} of iteration {it}")
            what = "row" if it not in by_iteration else "timeline"
            _missing(ax, f"{what} of iteration {it}")
            continue
        row, tasks = drawn[it]
        draw_timeline(ax, tasks, colours, int(row["timeline"]["world_size"]))
        ax.set_xlim(0, end * 1.02)
        ax.set_title(f"{PANELS[-1]} of iteration {it}{_step_text(row)}")
    if drawn:
        axes[-1].legend(handles=legend_handles(colours), fontsize="small", loc="upper left",
                        bbox_to_anchor=(1.0, 1.0))


def _step_text(row: dict[str, Any]) -> str:
    """``: step 0.520 s, predicted 0.400 s`` of a row (what it has of the two)."""
    parts = [f"{name} {float(row[key]):.3f} s" for name, key in
             (("step", "step_s"), ("predicted", "predicted_s")) if row.get(key) is not None]
    return ": " + ", ".join(parts) if parts else ""


def _missing(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this log", ha="center", va="center",
            transform=ax.transAxes, color="grey")


def _lines(ax, its, figs, named: list[tuple[str, str]], ylabel: str = "") -> bool:
    drawn = False
    for name, label in named:
        x, y = _series(its, figs, name)
        if x:
            ax.plot(x, y, marker=".", label=label)
            drawn = True
    if not drawn:
        _missing(ax, " / ".join(label for _, label in named))
        return False
    ax.set_ylabel(ylabel)
    if len(named) > 1:
        ax.legend(fontsize="small")
    return True


def _throughput(ax, its, figs) -> None:
    # trained (weight > 0) and run (what MFU counts): a loss mask sets them apart
    if not _lines(ax, its, figs, [("tokens_per_s", "tokens/s trained"),
                                  ("tokens_run_per_s", "tokens/s run")], ylabel="tokens/s"):
        return
    x, mfu = _series(its, figs, "mfu")
    if x:
        twin = ax.twinx()
        twin.plot(x, [100 * v for v in mfu], color="tab:red", marker=".", label="MFU")
        twin.set_ylabel("MFU %", color="tab:red")


def _degree_mix(ax, its, figs) -> None:
    what, names = _degree_names(figs)
    if not names:
        _missing(ax, "degrees")
        return
    x = [i for i, f in zip(its, figs) if any(n in f for n in names)]
    stacks = [[f.get(n, 0.0) for f in figs if any(m in f for m in names)] for n in names]
    ax.stackplot(x, stacks, labels=[f"degree {n.rsplit('_', 1)[1]}" for n in names])
    ax.set_ylabel(what)
    ax.legend(fontsize="small", loc="upper left")


def totals(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The run's totals for the page: iterations, tokens trained and run (where the rows say;
    older rows' ``tokens`` counted those run), mean tokens/s of each and MFU, last loss."""
    figs = [row_figures(r) for r in rows]
    out = {"iterations": str(len(rows))}
    tokens = sum(f.get("tokens", 0.0) for f in figs)
    seconds = sum(f.get("step_s", 0.0) for f in figs)
    out["tokens trained"] = f"{tokens:.0f}"
    run = sum(f["tokens_run"] for f in figs if "tokens_run" in f)
    if any("tokens_run" in f for f in figs):
        out["tokens run"] = f"{run:.0f}"
    if seconds:
        out["tokens/s trained"] = f"{tokens / seconds:.1f}"
        if "tokens run" in out:
            out["tokens/s run"] = f"{run / seconds:.1f}"
    mfu = [f["mfu"] for f in figs if "mfu" in f]
    if mfu:
        out["MFU (mean)"] = f"{100 * sum(mfu) / len(mfu):.2f} %"
    if "loss" in figs[-1]:
        out["last loss"] = f"{figs[-1]['loss']:.4f}"
    out["mode"] = str(rows[-1]["plan"]["mode"])
    return out


def output_paths(log: str, out: Optional[str] = None) -> tuple[str, str]:
    """(PNG, page) of ``--out``: a stem (``report/run``), or a file ending in .png or .html
    whose stem it is (``x.png`` writes x.png and x.html, not x.png.png); default: the log's
    path without its extension. `OutputError` for a folder (``DIR/``)."""
    if out is not None:
        if not out or out.endswith(os.sep) or os.path.isdir(out):
            raise OutputError(f"--out {out!r} is a folder or empty: give a stem such as "
                              f"{os.path.join(out or 'DIR', 'run')} (writes run.png and "
                              "run.html there)")
        stem, suffix = os.path.splitext(out)
        prefix = stem if suffix.lower() in (".png", ".html") else out
    else:
        prefix = os.path.splitext(log)[0]
    return prefix + ".png", prefix + ".html"


def check_outputs(log: str, out: Optional[str] = None, overwrite: bool = False
                  ) -> tuple[str, str]:
    """`output_paths`, each checked before the log is read (`output_problem`): neither may be
    the log itself (a log named ``run.html``), an existing file that dcp-report did not write
    is refused unless ``overwrite``; `OutputError` naming the path and the flag."""
    png, page = output_paths(log, out)
    for path in (png, page):
        if out is None and os.path.exists(log) and same_file(path, log):
            raise OutputError(f"{log}: the report would be written over the log itself (--out "
                              "defaults to the log's path without its extension); give --out "
                              f"a stem, such as {os.path.splitext(log)[0]}-report")
        problem = output_problem(path, flag="--out", tool=TOOL, inputs=[("log", log)],
                                 overwrite=overwrite, make_folder=True)
        if problem:
            raise OutputError(problem)
    return png, page


def report(log: str, out: Optional[str] = None, dpi: int = 80,
           timeline: Optional[Sequence[int]] = None, overwrite: bool = False,
           baseline: Optional[str] = None) -> tuple[str, str]:
    """Write ``OUT.png`` and ``OUT.html`` of the log (`output_paths`, checked by
    `check_outputs` first), with the timelines of the ``timeline`` iterations (default:
    `default_timeline`) and the loss and tokens/s of the plain run's log ``baseline`` drawn
    over the run's; returns both paths. Both carry dcp-report's `mark` (the PNG's
    ``Software`` text, the page's ``generator``), so a later report may replace them."""
    png, page = check_outputs(log, out, overwrite)
    rows = read_log(log)
    base = read_baseline(baseline) if baseline else None
    if os.path.dirname(png):
        os.makedirs(os.path.dirname(png), exist_ok=True)
    title = f"{os.path.basename(log)}: {len(rows)} iterations"
    if baseline:
        title += f" (baseline: {os.path.basename(baseline)})"
    chosen = default_timeline(rows) if timeline is None else list(timeline)
    fig = draw(rows, title, chosen, base)
    fig.savefig(png, dpi=dpi, metadata={"Software": mark(TOOL)})
    import matplotlib.pyplot as plt

    plt.close(fig)
    write_page(page, title, panels(rows, base, chosen, totals(rows)), png, mark(TOOL))
    return png, page


def dpi_flag(text: str) -> int:
    """``--dpi``: a whole number from 1 to `MAX_DPI`."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_DPI:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of dots per inch from 1 "
                                         f"to {MAX_DPI} (the figure is 13 inches wide)")
    return value


def iterations(text: str) -> list[int]:
    """``--timeline``: a comma list of iteration numbers."""
    try:
        chosen = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        chosen = []
    if not chosen or min(chosen) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: iteration numbers, e.g. 1,500")
    return chosen


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (``dcp-report``): exit status 0, 2 on a bad log or without matplotlib."""
    p = argparse.ArgumentParser(prog="dcp-report", description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="a --log-json or --dcp-log-json file (one JSON row per iteration)")
    p.add_argument("--out", default=None,
                   help="where to write: a stem (report/run: report/run.png and "
                        "report/run.html) or a file ending in .png or .html (its stem); "
                        "default: the log's path without its extension. Neither may be the "
                        "log itself")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--dpi", type=dpi_flag, default=80,
                   help=f"resolution of the PNG (1 to {MAX_DPI}, default 80)")
    p.add_argument("--timeline", type=iterations, default=None, metavar="ITER[,ITER]",
                   help="the iterations whose timeline the last row draws (their rows carry "
                        "one: the first and every --log-timeline-interval); default: the "
                        "first row with a timeline and the slowest of them")
    p.add_argument("--baseline", default=None, metavar="LOG",
                   help="a plain run's log (an examples' --log-json without --dcp, or "
                        "Megatron-LM's console output): its loss and tokens/s drawn dashed "
                        "over this run's")
    args = p.parse_args(argv)
    if args.baseline and not os.path.isfile(args.baseline):
        p.error(f"argument --baseline: {args.baseline}: no such file (give a plain run's "
                "--log-json or Megatron-LM's console log)")
    try:
        check_outputs(args.log, args.out, args.overwrite)
    except OutputError as err:
        p.error(str(err))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"error: dcp-report needs matplotlib: {EXTRA_HINT}", file=sys.stderr)
        return 2
    try:
        png, page = report(args.log, args.out, args.dpi, args.timeline, args.overwrite,
                           args.baseline)
    except (LogError, OutputError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {png}\nwrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
