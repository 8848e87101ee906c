"""The task as a model call sees it: `TaskContext` (group, sub-groups, layout, recomputed layers).

The task reaches attention, RoPE positions and recompute only through what the model is called
with (``dcp_attention(..., task=ctx)``, ``run_layer(..., task=ctx)``, Megatron's
``packed_seq_params``). There is no lookup of a "current" task: CUDA's autograd engine runs
backward, and a reentrant recompute re-runs forward, on its own worker thread, where a caller's
context variable is not visible, so the task travels as an argument (and a recompute keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

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
    sequence_weights: tuple = ()
    """Loss weight of every target token of each of the task's sequences (packing order): the
    plan's ``1 / T``, or ``1 / (S * targets)`` under the ``sequence`` reduction; 0 for an empty
    lockstep slot. Losses computed inside the model (an MoE router's auxiliary losses,
    `megatron_dcp.megatron.moe`) weight themselves with it."""
    mlp_tiles: Optional[int] = None
    """Chunks the MLP of every layer runs over (`megatron_dcp.runtime.tiling.tiled_mlp`);
    ``None``: the task's ``mlp_tiles``."""
    loss_tiles: Optional[int] = None
    """Chunks the output projection and loss run over (`tiled_logits_loss`); ``None``: the
    task's ``loss_tiles``."""
    offload_layers: Optional[int] = None
    """Recomputed layers whose saved inputs wait in host memory (`megatron_dcp.runtime.offload`);
    ``None``: the task's ``offload_layers``."""

    def __post_init__(self) -> None:
        for key in ("mlp_tiles", "loss_tiles", "offload_layers"):
            if getattr(self, key) is None:
                setattr(self, key, int(getattr(self.task, key, 0 if key == "offload_layers"
                                                else 1)))

    @property
    def id(self) -> int:
        """The plan task's id."""
        return self.task.id

    @property
    def degree(self) -> int:
        return self.task.degree
