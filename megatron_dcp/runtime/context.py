"""The task context: what the attention call and checkpoint control of a model see while a task runs.

Model code never takes DCP arguments: the executor enters ``task_context(ctx)`` around a task's
forward and backward, and `megatron_dcp.runtime.attention.dcp_attention` reads ``current_task()``.
A ``contextvars.ContextVar`` (not a module global that is configured once) so that the context is
scoped to the ``with`` block and nested or concurrent uses do not leak into each other.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Optional

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
    ckpt_layers: int = 0
    """Layers to recompute in this task (first ``ckpt_layers`` layers of the model)."""

    @property
    def degree(self) -> int:
        return self.task.degree


_CURRENT: ContextVar[Optional[TaskContext]] = ContextVar("megatron_dcp_task", default=None)


def current_task() -> Optional[TaskContext]:
    """The task context entered by the executor, or ``None`` outside a task."""
    return _CURRENT.get()


@contextmanager
def task_context(ctx: Optional[TaskContext]) -> Iterator[Optional[TaskContext]]:
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
