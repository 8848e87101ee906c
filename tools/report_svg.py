"""Inline SVG charts for ``dcp-report``'s page (`report_page`): no plotting library, no network.

Each chart is one ``<svg class="chart">`` string: axes with a few round ticks, a line per series
(a dot per point with a ``<title>``: the browser's tooltip and the page's readout), bars per
rank, or a timeline of tasks (ranks x seconds). The page's script zooms and pans every chart by
its ``viewBox`` (`report_page.SCRIPT`), so the charts need no code of their own.
"""

from __future__ import annotations

import html
import math
from typing import Optional, Sequence

WIDTH, HEIGHT = 640, 280
LEFT, RIGHT, TOP, BOTTOM = 64, 56, 36, 40
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
MAX_DOTS = 1500
"""Dots (each with a tooltip) drawn per series; a longer series is a line only."""

Series = tuple[str, Sequence[float], Sequence[float]]
"""(label, x values, y values) of one line."""


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def number(value: float) -> str:
    """A value for a tick or tooltip: 4 significant digits, thousands separated."""
    if value == 0 or not math.isfinite(value):
        return str(value if math.isfinite(value) else "-")
    if abs(value) >= 1e4:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def ticks(low: float, high: float, count: int = 5, whole: bool = False) -> list[float]:
    """About ``count`` round values from ``low`` to ``high`` (1, 2 or 5 times a power of 10;
    ``whole``: whole numbers only, for iterations and ranks)."""
    if not high > low:
        return [low]
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    step = max(step, 1) if whole else step
    first = math.ceil(low / step) * step
    return [first + k * step for k in range(int((high - first) / step + 1e-9) + 1)]


class Frame:
    """The mapping of data to pixels of one chart (x from ``xs``, y from ``ys``; y from 0
    where all values are >= 0, so a bar or a rate reads against zero)."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float], width: int = WIDTH,
                 height: int = HEIGHT) -> None:
        self.width, self.height = width, height
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        low = min(ys) if ys else 0.0
        self.y0 = 0.0 if low >= 0 else low
        self.y1 = max(ys) if ys else 1.0
        if self.x1 <= self.x0:
            self.x0, self.x1 = self.x0 - 0.5, self.x1 + 0.5
        if self.y1 <= self.y0:
            self.y1 = self.y0 + (abs(self.y0) or 1.0)

    def x(self, v: float) -> float:
        return LEFT + (v - self.x0) / (self.x1 - self.x0) * (self.width - LEFT - RIGHT)

    def y(self, v: float) -> float:
        return self.height - BOTTOM - (v - self.y0) / (self.y1 - self.y0) * (
            self.height - TOP - BOTTOM)


def _axes(frame: Frame, xlabel: str, ylabel: str, right: Optional[Frame] = None,
          right_label: str = "") -> list[str]:
    WIDTH, HEIGHT = frame.width, frame.height  # noqa: N806 (this chart's size)
    out = [f'<line class="axis" x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" '
           f'y2="{HEIGHT - BOTTOM}"/>',
           f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}"/>']
    for v in ticks(frame.x0, frame.x1, 8, whole=xlabel != "seconds"):
        out.append(f'<text class="tick" x="{frame.x(v):.1f}" y="{HEIGHT - BOTTOM + 14}" '
                   f'text-anchor="middle">{_esc(number(v))}</text>')
    ranks = ylabel == "rank"  # a timeline: rank r is the row from r to r + 1
    for v in ticks(frame.y0, frame.y1, whole=ranks):
        if ranks and v >= frame.y1:
            continue
        at = frame.y(v + 0.5 if ranks else v)
        out.append(f'<text class="tick" x="{LEFT - 4}" y="{at + 4:.1f}" '
                   f'text-anchor="end">{_esc(number(v))}</text>')
        out.append(f'<line class="grid" x1="{LEFT}" y1="{frame.y(v):.1f}" '
                   f'x2="{WIDTH - RIGHT}" y2="{frame.y(v):.1f}"/>')
    out.append(f'<text class="label" x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" '
               f'text-anchor="middle">{_esc(xlabel)}</text>')
    out.append(f'<text class="label" transform="translate(14 {(TOP + HEIGHT - BOTTOM) / 2}) '
               f'rotate(-90)" text-anchor="middle">{_esc(ylabel)}</text>')
    if right is not None:
        for v in ticks(right.y0, right.y1):
            out.append(f'<text class="tick" x="{WIDTH - RIGHT + 4}" y="{right.y(v) + 4:.1f}">'
                       f'{_esc(number(v))}</text>')
        out.append(f'<text class="label" transform="translate({WIDTH - 8} '
                   f'{(TOP + HEIGHT - BOTTOM) / 2}) rotate(90)" text-anchor="middle">'
                   f'{_esc(right_label)}</text>')
    return out


def _legend(labels: Sequence[str], colours: Sequence[str], width: int = WIDTH) -> list[str]:
    """Coloured squares with their labels above the plot, in rows that fit its width."""
    out, x, y = [], LEFT, 4
    for label, colour in zip(labels, colours):
        if x > LEFT and x + 14 + 6 * len(label) > width - RIGHT:
            x, y = LEFT, y + 13
        out.append(f'<rect x="{x}" y="{y}" width="9" height="9" fill="{colour}"/>'
                   f'<text class="legend" x="{x + 13}" y="{y + 9}">{_esc(label)}</text>')
        x += 22 + 6 * len(label)
    return out


def _svg(name: str, body: list[str], width: int = WIDTH, height: int = HEIGHT) -> str:
    return (f'<svg class="chart" data-chart="{_esc(name)}" viewBox="0 0 {width} {height}" '
            f'xmlns="http://www.w3.org/2000/svg" role="img"><title>{_esc(name)}</title>'
            + "".join(body) + "</svg>")


def _polyline(frame: Frame, label: str, xs: Sequence[float], ys: Sequence[float],
              colour: str, dashed: bool = False) -> list[str]:
    points = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in zip(xs, ys))
    dash = ' stroke-dasharray="5 3"' if dashed else ""
    out = [f'<polyline class="series" data-series="{_esc(label)}" fill="none" '
           f'stroke="{colour}" stroke-width="1.5"{dash} points="{points}"/>']
    if len(xs) <= MAX_DOTS:
        out += [f'<circle class="dot" cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="2.5" '
                f'fill="{colour}"><title>{_esc(label)}: {_esc(number(y))} at '
                f'{_esc(number(x))}</title></circle>' for x, y in zip(xs, ys)]
    return out


def line_chart(name: str, series: Sequence[Series], *, ylabel: str, xlabel: str = "iteration",
               right: Sequence[Series] = (), right_label: str = "",
               dashed: Sequence[str] = ()) -> str:
    """Lines of ``series`` against the left axis and ``right`` against a right one (e.g. MFU
    beside tokens/s); a series whose label is in ``dashed`` is drawn dashed (a baseline)."""
    xs = [x for s in (*series, *right) for x in s[1]]
    frame = Frame(xs, [y for s in series for y in s[2]])
    other = None
    if right:
        other = Frame(xs, [y for s in right for y in s[2]])
    body = _axes(frame, xlabel, ylabel, other, right_label)
    labels, colours = [], []
    for k, (label, sx, sy) in enumerate((*series, *right)):
        colour = COLOURS[k % len(COLOURS)]
        use = frame if k < len(series) else other
        body += _polyline(use, label, sx, sy, colour, label in dashed)
        labels.append(label)
        colours.append(colour)
    return _svg(name, body + _legend(labels, colours))


def bar_chart(name: str, bars: Sequence[tuple[str, Sequence[float]]], *, ylabel: str,
              xlabel: str = "rank") -> str:
    """Grouped bars: for each (label, values) one bar per index (a rank), side by side."""
    count = max((len(v) for _, v in bars), default=0)
    frame = Frame([-0.5, count - 0.5], [y for _, v in bars for y in v])
    body = _axes(frame, xlabel, ylabel)
    slot = (frame.x(1) - frame.x(0)) / max(len(bars), 1) * 0.8
    for k, (label, values) in enumerate(bars):
        colour = COLOURS[k % len(COLOURS)]
        for rank, value in enumerate(values):
            x = frame.x(rank) - 0.4 * (frame.x(1) - frame.x(0)) + k * slot
            top = frame.y(max(value, frame.y0))
            body.append(f'<rect class="bar" x="{x:.1f}" y="{top:.1f}" width="{slot:.1f}" '
                        f'height="{frame.y(frame.y0) - top:.1f}" fill="{colour}"><title>'
                        f'rank {rank}: {_esc(label)} {_esc(number(value))}</title></rect>')
    return _svg(name, body + _legend([b[0] for b in bars],
                                     [COLOURS[k % len(COLOURS)] for k in range(len(bars))]))


MARK_COLOURS = ("#000", "#9467bd", "#d62728", "#555")
"""The vertical lines of a timeline: plan makespan, measured tasks, predicted, measured step."""

TimelineBar = tuple[int, float, float, int, int, str]
"""(rank, start s, duration s, degree, recomputed layers, lane: "predicted" or "measured")."""


def timeline_chart(name: str, bars: Sequence[TimelineBar], world: int,
                   marks: Sequence[tuple[str, float]] = ()) -> str:
    """Ranks (rows) x seconds: each rank's row holds its predicted tasks (upper half) and,
    where given, the measured ones (lower half, lighter), a colour per degree, recomputed
    tasks outlined; ``marks``: labelled vertical lines (predicted and measured step ends)."""
    end = max([s + d for _, s, d, *_ in bars] + [v for _, v in marks] + [1e-9])
    height = TOP + BOTTOM + min(max(24 * world, 200), 900)
    frame = Frame([0.0, end], [0.0, float(world)], 2 * WIDTH, height)
    frame.y0, frame.y1 = 0.0, float(world)
    body = _axes(frame, "seconds", "rank")
    degrees = sorted({b[3] for b in bars})
    colour = {d: COLOURS[k % len(COLOURS)] for k, d in enumerate(degrees)}
    lane = (frame.y(0) - frame.y(1)) / 2
    for rank, start, duration, degree, recompute, kind in bars:
        top = frame.y(rank + 1) + (lane if kind == "measured" else 0)
        style = ' stroke="#000" stroke-width="1"' if recompute else \
            ' stroke="#fff" stroke-width="0.5"'
        opacity = 0.55 if kind == "measured" else 1.0
        body.append(f'<rect class="task {kind}" x="{frame.x(start):.2f}" y="{top:.2f}" '
                    f'width="{max(frame.x(start + duration) - frame.x(start), 0.5):.2f}" '
                    f'height="{lane * 0.9:.2f}" fill="{colour[degree]}" '
                    f'fill-opacity="{opacity}"{style}><title>rank {rank}: {kind} '
                    f'{_esc(number(start))} s + {_esc(number(duration))} s, degree {degree}, '
                    f'{recompute} layers recomputed</title></rect>')
    for k, (label, at) in enumerate(marks):
        body.append(f'<line class="mark" x1="{frame.x(at):.1f}" y1="{TOP}" x2="{frame.x(at):.1f}"'
                    f' y2="{height - BOTTOM}" stroke="{MARK_COLOURS[k % 4]}" '
                    f'stroke-dasharray="4 2"><title>{_esc(label)}: {_esc(number(at))} s</title>'
                    f'</line>')
    return _svg(name, body + _legend([f"degree {d}" for d in degrees] + [
        label for label, _ in marks], [colour[d] for d in degrees] + list(
            MARK_COLOURS[:len(marks)]), 2 * WIDTH), 2 * WIDTH, height)
