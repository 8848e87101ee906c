"""DCP's figures through DeepSpeed's own monitor (``engine.monitor``).

When the DeepSpeed JSON enables ``tensorboard``, ``wandb`` or ``csv_monitor``, DeepSpeed writes
its own events through ``engine.monitor.write_events([(name, value, step)])`` on rank 0.
`DeepSpeedMonitor` adds every figure of each DCP step there (`megatron_dcp.runtime.figures`,
named ``dcp/<figure>``, at DeepSpeed's own step axis, ``global_samples``), so they land in the
same TensorBoard run, W&B run or CSV files; a training script adds nothing.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_dcp.runtime.figures import StepFigures, check_monitor_packages, scalars

MONITOR_SECTIONS = ("tensorboard", "wandb", "csv_monitor")
"""The sections of a DeepSpeed JSON that turn its monitor on (and these figures with it)."""


def check_monitor_config(config: dict[str, Any]) -> None:
    """At start: a DeepSpeed JSON that enables ``tensorboard`` or ``wandb`` without its package
    installed is an error naming the extra (DeepSpeed would print a hint and raise later)."""
    def enabled(section: str) -> bool:
        value = config.get(section)
        return isinstance(value, dict) and bool(value.get("enabled"))

    for section in ("tensorboard", "wandb"):
        check_monitor_packages(**{section: enabled(section)},
                               asked_by=f'the DeepSpeed config\'s "{section}" section')


class DeepSpeedMonitor:
    """Writes each step's figures to a DeepSpeed engine's ``monitor`` (its ``MonitorMaster``:
    ``enabled``, ``write_events``) at the engine's ``global_samples``, the step axis of
    DeepSpeed's own events (W&B refuses a step below one already logged). ``figures``: the
    run's `StepFigures`; ``rank``: this process's global rank (DeepSpeed's monitor writes on
    rank 0 only, so the figures are computed there only)."""

    def __init__(self, engine: Any, figures: StepFigures, rank: int) -> None:
        self.engine = engine
        self.figures = figures
        self.rank = rank

    @property
    def active(self) -> bool:
        """Whether this rank writes: rank 0 of a run whose DeepSpeed JSON enables a monitor."""
        monitor = getattr(self.engine, "monitor", None)
        return self.rank == 0 and bool(getattr(monitor, "enabled", False))

    def write(self, result: Any) -> Optional[dict[str, float]]:
        """Write the figures of ``result`` (a `StepResult`); returns them (``None`` where this
        rank does not write)."""
        if not self.active:
            return None
        figures = self.figures(result)
        self.engine.monitor.write_events(scalars(figures, self.engine.global_samples))
        return figures
