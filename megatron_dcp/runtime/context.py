"""The task as a model call sees it: `TaskContext` (group, sub-groups, layout, recomputed layers).

The task reaches attention, RoPE positions and recompute only through what the model is called
with (``dcp_attention(..., task=ctx)``, ``run_layer(..., task=ctx)``, Megatron's
``packed_seq_params``). There is no lookup of a "current" task: CUDA's autograd engine runs
backward, and a reentrant recompute re-runs forward, on its own worker thread, where a caller's
context variable is not visible, so the task travels as an argument (and a recompute keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_dcp.plan.plan import Task


@dataclass
class TaskContext:
    """One task as seen by one rank of its group."""

    task: Task
    group_rank: int
    """This rank's position in ``task.ranks``."""
    group: Any = None
    """Process group of the whole task (``None`` when the task has one rank)."""
    ulysses_group: Any = None
    """Process group of this rank's Ulysses sub-group (``None`` when ``task.ulysses == 1``)."""
    ring_group: Any = None
    """Process group of this rank's ring sub-group (``None`` when ``task.ring == 1``)."""
    layout: Any = None
    """`megatron_dcp.runtime.layout.ShardLayout` of this rank's shard of the task's sequences."""
    recompute_layers: int = 0
    """Layers to recompute in this task (first ``recompute_layers`` layers of the model)."""

    @property
    def degree(self) -> int:
        return self.task.degree
