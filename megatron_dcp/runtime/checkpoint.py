"""Per-task activation recomputation: how many layers recompute is read at every forward.

A DCP plan gives every task its own recompute depth (``Task.recompute_layers``): a long sequence
at a low degree recomputes many layers, a packed task of short sequences none. The model is built
once; each layer call goes through `run_layer(i, layer, *args, task=task)`, which reads the depth of
the task the model was called with and wraps the first ``depth`` layers in non-reentrant
``torch.utils.checkpoint``. So the depth changes every micro-step without rebuilding anything.

Recomputation happens during backward, on CUDA on the autograd engine's worker thread. The model
passes the task to its layers as an argument, so it recomputes with the same task wherever it
runs (the checkpoint keeps the arguments); nothing is looked up from the calling thread.

Outside a task the depth is 0, or what `recompute_outside_task` sets (single-process references,
profiling).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint

from megatron_dcp.runtime.context import TaskContext

_DEPTH_OUTSIDE_TASK: ContextVar[int] = ContextVar("megatron_dcp_ckpt_depth", default=0)


@contextmanager
def recompute_outside_task(depth: int) -> Iterator[int]:
    """Recompute the first ``depth`` layers of forwards run outside a task (inside a task the
    task's own ``recompute_layers`` wins)."""
    if depth < 0:
        raise ValueError(f"checkpoint depth must be >= 0, got {depth}")
    token = _DEPTH_OUTSIDE_TASK.set(int(depth))
    try:
        yield depth
    finally:
        _DEPTH_OUTSIDE_TASK.reset(token)


def current_recompute_layers(task: Optional[TaskContext] = None) -> int:
    """Number of leading layers to recompute in a forward for ``task`` (``None``: outside a
    task, `recompute_outside_task`)."""
    if task is not None:
        return int(task.recompute_layers)
    return _DEPTH_OUTSIDE_TASK.get()


def run_layer(index: int, layer: Callable[..., torch.Tensor], *args: Any,
              task: Optional[TaskContext] = None) -> torch.Tensor:
    """Run ``layer(*args)``, recomputing its activations in backward if ``index < depth``.

    ``index`` is the layer's position in the model (0 = first); ``task`` the task the model was
    called with (``None``: outside a task). Pass the task to the layer in ``args`` too: the
    layer's attention takes it, and a recompute gets the same arguments. Recomputation is only
    used when autograd records the forward (no effect under ``torch.no_grad``).
    """
    if index < current_recompute_layers(task) and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
    return layer(*args)
