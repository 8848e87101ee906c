"""Per-task activation recomputation: how many layers recompute is read at every forward.

A DCP plan gives every task its own number of recomputed layers (``Task.recompute_layers``): a
long sequence at a low degree recomputes many layers, a packed task of short sequences none. The
model is built once; each layer call goes through `run_layer(i, layer, *args, task=task)`, which
reads ``recompute_layers`` of the task the model was called with and wraps that many first layers
in non-reentrant ``torch.utils.checkpoint``. So the number changes every micro-step without
rebuilding anything.

Recomputation happens during backward, on CUDA on the autograd engine's worker thread. The model
passes the task to its layers as an argument, so it recomputes with the same task wherever it
runs (``torch.utils.checkpoint`` keeps the arguments); nothing is looked up from the calling
thread.

Outside a task no layer recomputes, or the number `recompute_outside_task` sets (single-process
references, profiling).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint

from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.offload import offload_layers_of, offloaded_layer

_LAYERS_OUTSIDE_TASK: ContextVar[int] = ContextVar("megatron_dcp_recompute_layers", default=0)


@contextmanager
def recompute_outside_task(recompute_layers: int) -> Iterator[int]:
    """Recompute the first ``recompute_layers`` layers of forwards run outside a task (inside a
    task the task's own ``recompute_layers`` wins)."""
    if recompute_layers < 0:
        raise ValueError(f"recompute_layers must be >= 0, got {recompute_layers}")
    token = _LAYERS_OUTSIDE_TASK.set(int(recompute_layers))
    try:
        yield recompute_layers
    finally:
        _LAYERS_OUTSIDE_TASK.reset(token)


def current_recompute_layers(task: Optional[TaskContext] = None) -> int:
    """Number of leading layers to recompute in a forward for ``task`` (``None``: outside a
    task, `recompute_outside_task`)."""
    if task is not None:
        return int(task.recompute_layers)
    return _LAYERS_OUTSIDE_TASK.get()


def run_layer(index: int, layer: Callable[..., torch.Tensor], *args: Any,
              task: Optional[TaskContext] = None, stash: Any = None) -> torch.Tensor:
    """Run ``layer(*args)``, recomputing its activations in backward if ``index`` is below the
    task's ``recompute_layers``.

    ``index`` is the layer's position in the model (0 = first); ``task`` the task the model was
    called with (``None``: outside a task). Pass the task to the layer in ``args`` too: the
    layer's attention takes it, and a recompute gets the same arguments. Recomputation is only
    used when autograd records the forward (no effect under ``torch.no_grad``).

    ``stash``: the `megatron_dcp.runtime.offload.HostStash` of this forward (from
    ``stash_for(task)``); a layer below the task's ``offload_layers`` then keeps its first
    argument in host memory between forward and backward (`offloaded_layer`).
    """
    if stash is not None and index < offload_layers_of(task) and torch.is_grad_enabled():
        return offloaded_layer(layer, *args, stash=stash)
    if index < current_recompute_layers(task) and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
    return layer(*args)
