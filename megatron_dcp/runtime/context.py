"""The task context: which task (group, layout, recompute depth) a model call runs for.

The task reaches attention, RoPE positions and recompute through what the model is called with
(``dcp_attention(..., task=ctx)``, ``run_layer(..., task=ctx)``, Megatron's
``packed_seq_params``). For user models that never take DCP arguments, the executor also enters
``task_context(ctx)`` around a task's forward and backward, and `current_task` reads it.

`current_task` reads a ``ContextVar`` set by ``task_context`` in the calling thread. A thread
that never entered a task context (CUDA's autograd engine runs backward, and reentrant
checkpoints re-run forward, on its own worker thread, where the caller's ``ContextVar`` is not
visible) falls back to the task most recently entered in the process. Tasks of one rank run one
after another (a task's backward ends before the next task's forward starts), so that fallback is
the task being run.
"""

from __future__ import annotations

import threading
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
    recompute_layers: int = 0
    """Layers to recompute in this task (first ``recompute_layers`` layers of the model)."""

    @property
    def degree(self) -> int:
        return self.task.degree


_UNSET = object()
_CURRENT: ContextVar[Any] = ContextVar("megatron_dcp_task", default=_UNSET)


class _ProcessTask:
    """The task most recently entered by ``task_context`` in any thread (the fallback)."""

    lock = threading.Lock()
    ctx: Optional[TaskContext] = None


def current_task(explicit: Optional[TaskContext] = None) -> Optional[TaskContext]:
    """The task a call runs for: ``explicit`` if given, else the context entered in this thread,
    else (a thread that never entered one: CUDA's autograd worker) the process's current task."""
    if explicit is not None:
        return explicit
    ctx = _CURRENT.get()
    if ctx is _UNSET:
        return _ProcessTask.ctx
    return ctx


@contextmanager
def task_context(ctx: Optional[TaskContext]) -> Iterator[Optional[TaskContext]]:
    """Run the block as task ``ctx`` (``None``: outside any task) in this thread and, for threads
    that never enter a context themselves, in the process."""
    token = _CURRENT.set(ctx)
    with _ProcessTask.lock:
        previous, _ProcessTask.ctx = _ProcessTask.ctx, ctx
    try:
        yield ctx
    finally:
        with _ProcessTask.lock:
            _ProcessTask.ctx = previous
        _CURRENT.reset(token)
