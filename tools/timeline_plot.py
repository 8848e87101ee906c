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


def draw_timeline(ax: Any, tasks: Iterable[Task], colours: dict[int, Any],
                  world_size: int) -> None:
    """Draw ``tasks`` on ``ax`` (one ``broken_barh`` per task and rank), ranks
    ``0..world_size-1`` top to bottom, seconds along x."""
    for start, duration, degree, recompute, ranks in tasks:
        hatch = RECOMPUTE_HATCH if recompute else None
        for rank in ranks:
            ax.broken_barh([(start, duration)], (rank - 0.4, 0.8), facecolors=colours[degree],
                           edgecolor="white", linewidth=0.3, hatch=hatch)
    from matplotlib.ticker import MaxNLocator

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
