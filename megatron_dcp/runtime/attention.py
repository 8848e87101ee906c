"""`dcp_attention`: the attention call of a model under DCP, for whatever layout the task has.

The model calls ``dcp_attention(q, k, v, task=task)`` on its local shard, with the
`TaskContext` its forward was called with (group, layout, degrees); nothing else carries the
task: ``task=None`` is attention outside any task (one whole sequence). Layouts:

* degree 1: local attention over the task's packed sequences (varlen);
* Ulysses (``ulysses > 1``): all-to-all from sequence to head sharding inside the Ulysses
  group, local attention over the whole sequences for this rank's heads, all-to-all back;
* ring (``ring > 1``): `megatron_dcp.runtime.ring.RingAttention` over the ring group;
* hybrid: the Ulysses all-to-all first, then the ring over the ring sub-group on the Ulysses
  rank's heads (the ring portion's tokens of all Ulysses peers), then the all-to-all back.

Every input check happens before the first collective, so a bad input raises on every rank of
the group alike instead of hanging or poisoning the group.

Attention groups (video) are given as a function of token positions, or, when the groups depend
on the sequence too (videos of different frame sizes packed into one task), as a function of
positions and task-local sequence ids marked ``per_sequence = True`` (`per_sequence_groups`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.kernels import attention_groups, local_attention
from megatron_dcp.runtime.layout import TokenMeta
from megatron_dcp.runtime.ring import RingComm, ring_attention
from megatron_dcp.runtime.ulysses import HeadToSeq, SeqToHeadQKV, UlyssesComm


class _BoundToSequences:
    """A per-sequence group function bound to the sequence ids of one token set: the
    positions-only callable `attention_groups` takes (and caches by: equal for the same function
    and the same token set, so forward, recompute and backward reuse one decomposition)."""

    __slots__ = ("fn", "seq_ids")

    def __init__(self, fn: Callable, seq_ids: torch.Tensor) -> None:
        self.fn, self.seq_ids = fn, seq_ids

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        return self.fn(positions, self.seq_ids)

    def __hash__(self) -> int:
        return hash((self.fn, id(self.seq_ids)))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _BoundToSequences) and self.fn == other.fn
                and self.seq_ids is other.seq_ids)


def per_sequence_groups(group_fn: Optional[Callable], meta: TokenMeta) -> Optional[torch.Tensor]:
    """Attention-group ids of the tokens of ``meta`` (on its device; ``None``: no groups).

    ``group_fn(positions)``, or ``group_fn(positions, seq_ids)`` (task-local sequence ids) when
    ``group_fn.per_sequence`` is true: groups that follow each sequence's own shape, such as the
    frames of videos of different resolutions packed into one task.
    """
    if group_fn is not None and getattr(group_fn, "per_sequence", False):
        group_fn = _BoundToSequences(group_fn, meta.host().seq_ids)
    return attention_groups(group_fn, meta)


def _check_shapes(q, k, v, where: str) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"dcp_attention ({where}): q, k, v must be [tokens, heads, head_dim]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"dcp_attention ({where}): shapes do not match: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"dcp_attention ({where}): query heads {q.shape[1]} not divisible by "
                         f"key/value heads {k.shape[1]} (GQA)")


def _check_task(ctx: TaskContext, q, k, v) -> None:
    task, layout = ctx.task, ctx.layout
    where = f"task {task.id}, ranks {task.ranks}, group rank {ctx.group_rank}"
    _check_shapes(q, k, v, where)
    if layout is None:
        raise ValueError(f"dcp_attention ({where}): the task context has no layout")
    if (layout.ulysses, layout.ring) != (task.ulysses, task.ring):
        raise ValueError(f"dcp_attention ({where}): layout is ulysses {layout.ulysses} x ring "
                         f"{layout.ring}, task is {task.ulysses} x {task.ring}")
    if q.shape[0] != layout.num_tokens:
        raise ValueError(f"dcp_attention ({where}): {q.shape[0]} local tokens given, the layout "
                         f"holds {layout.num_tokens}")
    u = task.ulysses
    if u > 1 and (q.shape[1] % u or k.shape[1] % u):
        raise ValueError(f"dcp_attention ({where}): Ulysses degree {u} must divide both the query "
                         f"heads ({q.shape[1]}) and the key/value heads ({k.shape[1]}); use a ring "
                         f"or hybrid layout for this task")
    if u > 1 and ctx.ulysses_group is None and not (task.ring == 1 and ctx.group is not None):
        raise ValueError(f"dcp_attention ({where}): Ulysses degree {u} but no Ulysses group")
    if task.ring > 1 and ctx.ring_group is None and not (u == 1 and ctx.group is not None):
        raise ValueError(f"dcp_attention ({where}): ring degree {task.ring} but no ring group")


def dcp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                  softmax_scale: Optional[float] = None,
                  group_of_position: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                  task: Optional[TaskContext] = None,
                  deterministic: Optional[bool] = None) -> torch.Tensor:
    """Attention of the local shard ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` -> ``[T, Hq, D]``.

    Inside a task (``task``), tokens attend within their sequence across
    the whole group as the task's layout says; outside, the tokens given are one sequence at
    positions 0..T-1.
    ``group_of_position`` maps positions to attention-group ids (video: frame index for spatial
    attention, spatial index for temporal attention); tokens attend only within their group.
    With ``group_of_position.per_sequence`` true it is called with the task-local sequence ids
    too (`per_sequence_groups`; outside a task they are all 0). Differentiable.
    ``deterministic``: a deterministic backward (a framework's switch, such as Megatron's
    ``deterministic_mode``; default: ``torch.are_deterministic_algorithms_enabled()``).
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ctx = task
    if ctx is None:
        _check_shapes(q, k, v, "outside a task")
        meta = TokenMeta.contiguous(q.shape[0], q.device)
        return local_attention(q, k, v, meta, causal=causal, softmax_scale=scale,
                               groups=per_sequence_groups(group_of_position, meta),
                               deterministic=deterministic)
    _check_task(ctx, q, k, v)
    planned, layout = ctx.task, ctx.layout
    u, r = planned.ulysses, planned.ring
    # Metadata and attention groups first: a bad group_of_position fails before any collective.
    metas = [layout.portion(j).to(q.device) for j in range(r)]
    groups = [per_sequence_groups(group_of_position, m) for m in metas]
    if u > 1:
        comm = UlyssesComm(ctx.ulysses_group if ctx.ulysses_group is not None else ctx.group,
                           planned.ulysses_group(ctx.group_rank))
        q, k, v = SeqToHeadQKV.apply(comm, q, k, v)
    if r == 1:
        out = local_attention(q, k, v, metas[0], causal=causal, softmax_scale=scale,
                              groups=groups[0], deterministic=deterministic)
    else:
        ring = RingComm(ctx.ring_group if ctx.ring_group is not None else ctx.group,
                        planned.ring_group(ctx.group_rank), layout.ring_rank)
        out = ring_attention(q, k, v, ring, metas, groups, causal=causal, scale=scale,
                             deterministic=deterministic)
    if u > 1:
        out = HeadToSeq.apply(comm, out)
    return out


