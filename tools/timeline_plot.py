"""A plan's timeline drawn on a matplotlib ``Axes``: one row per rank (rank 0 at the top), one
bar per task and rank from its start for its duration, coloured by the task's degree, hatched
where it recomputes layers. The one drawing code of ``dcp-simulate --plot`` (a plan at its
simulated times) and ``dcp-report`` (a log row's ``timeline``, `megatron_dcp.runtime.report`).

A task is ``(start s, duration s, degree, recomputed layers, ranks)``. The caller imports
matplotlib (``pip install 'megatron-dcp[plot]'``).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

Task = tuple[float, float, int, int, Sequence[int]]

RECOMPUTE_HATCH = "//"


def degree_colours(degrees: Iterable[int]) -> dict[int, Any]:
    """A colour per degree (viridis, smallest degree darkest), the same in every panel that
    shares the dict."""
    import matplotlib

    ordered = sorted(set(degrees))
    cmap = matplotlib.colormaps["viridis"].resampled(max(2, len(ordered)))
    return {d: cmap(i) for i, d in enumerate(ordered)}


MAX_BARS = 50_000
"""The most bars (tasks x their ranks) a timeline panel draws: about 20 s of drawing on a slow
CPU; a larger timeline (a crafted log row, a plan of 100,000 ranks) gets `crowded_note`."""


def crowded_note(ax: Any, bars: int) -> None:
    """The panel of a timeline of more than `MAX_BARS` bars: says so, draws none."""
    ax.text(0.5, 0.5, f"{bars:,} bars (tasks x ranks): more than the {MAX_BARS:,} a panel "
            "draws", ha="center", va="center", transform=ax.transAxes, color="grey", wrap=True)


def draw_timeline(ax: Any, tasks: Iterable[Task], colours: dict[int, Any],
                  world_size: int) -> None:
    """Draw ``tasks`` on ``ax``, ranks ``0..world_size-1`` top to bottom, seconds along x: one
    bar per task and rank, gathered into one collection per (degree, recompute) look (a
    `broken_barh` per bar took ~10 ms each: minutes for a timeline of thousands of bars)."""
    import numpy as np
    from matplotlib.collections import PolyCollection
    from matplotlib.ticker import MaxNLocator

    bars: dict[tuple[int, bool], list[tuple[float, float, int]]] = {}
    for start, duration, degree, recompute, ranks in tasks:
        bars.setdefault((degree, bool(recompute)), []).extend(
            (start, duration, rank) for rank in ranks)
    for (degree, recompute), rows in sorted(bars.items()):
        start, duration, rank = (np.asarray(c, dtype=float) for c in zip(*rows))
        x0, x1, y0, y1 = start, start + duration, rank - 0.4, rank + 0.4
        verts = np.stack([np.stack([x0, y0], 1), np.stack([x0, y1], 1),
                          np.stack([x1, y1], 1), np.stack([x1, y0], 1)], 1)
        ax.add_collection(PolyCollection(verts, facecolors=[colours[degree]],
                                         edgecolors="white", linewidths=0.3,
                                         hatch=RECOMPUTE_HATCH if recompute else None))
    if bars:
        ax.autoscale_view(scaley=False)
    ax.set_ylim(world_size - 0.5, -0.5)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # ranks, not fractions
    ax.set_xlabel("seconds")
    ax.set_ylabel("rank")


def legend_handles(colours: dict[int, Any]) -> list:
    """Legend entries: one per degree, and the recompute hatch."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, label=f"degree {d}") for d, c in sorted(colours.items())]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch=RECOMPUTE_HATCH,
                         label="recompute"))
    return handles
