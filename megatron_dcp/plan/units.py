"""Sizes and counts in messages, in units that keep their figures (a tiny budget is not
"0.0 GiB", a tiny model not "0.00B parameters"). From 1 GiB and 1B on, the figures are the
ones messages always printed (``"80.0 GiB"``, ``"6.74B"``)."""

from __future__ import annotations


def size_text(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it at least 1: ``"512 B"``,
    ``"1.5 KiB"``, ``"12.0 MiB"``, ``"80.0 GiB"`` (GiB also above 1024 GiB)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def count_text(count: float) -> str:
    """``count`` with K, M or B and two decimals: ``"950"``, ``"12.35K"``, ``"6.74B"``."""
    value = float(count)
    for unit in ("", "K", "M"):
        if abs(value) < 1000:
            return f"{value:.0f}" if not unit else f"{value:.2f}{unit}"
        value /= 1000
    return f"{value:.2f}B"
