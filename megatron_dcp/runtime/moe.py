"""Mixture-of-experts pieces the engines share: a router loss attached to a tensor, and the
load-balancing loss of whole sequences from a task's shard of them.

A router's load-balancing loss is a product of two averages over a set of tokens: the share of
assignments each expert gets (a count: no gradient) and its mean router probability (the
gradient). Over a micro-batch its value depends on which sequences share the micro-batch and
whether a rank holds a whole sequence, i.e. on the plan. Per sequence it does not: the counts
of a sequence's tokens are summed over every rank that holds a piece of it (one all-reduce over
the task's group), the probabilities stay local (their gradient is the local tokens'), and the
sum of the ranks' parts is the sequence's loss, for any plan.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_dcp.runtime.context import TaskContext

__all__ = ["AttachLoss", "TaskRows", "sequence_balancing_loss", "task_rows"]


class AttachLoss(torch.autograd.Function):
    """``AttachLoss.apply(x, loss, scale=1.0)`` returns ``x``; backward of ``x`` also runs
    backward of ``loss`` with gradient ``scale`` (a loss computed inside the model, added to the
    objective without changing what the model returns)."""

    @staticmethod
    def forward(ctx, x, loss, scale: float = 1.0):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        # ``scale``: a float, or a tensor on the loss's device (an fp16 loss scale, never read
        # on the host: no sync)
        return grad, torch.ones_like(loss) * ctx.scale, None


class TaskRows(NamedTuple):
    """A task's shard rows on the device, for the router losses: each row's task-local
    sequence, whether it is a real token, each sequence's length and loss weight, and the real
    rows' indices with their sequences (``kept``, ``kept_seq_ids``: indexing with them reads no
    count on the host, as a boolean mask does)."""

    seq_ids: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    kept_seq_ids: torch.Tensor


_ROWS: "OrderedDict[tuple, tuple[Any, TaskRows]]" = OrderedDict()
_ROWS_KEPT = 8
"""Tasks whose rows stay on the device: a task's forward and its recompute in backward reuse
them; every MoE layer of a task shares them."""


def task_rows(layout: Any, weights: Sequence[float], device: torch.device) -> TaskRows:
    """The `TaskRows` of a task's ``layout`` on ``device``, copied once per task (from pinned
    host memory, without a sync, on a GPU) and shared by every MoE layer of the task and its
    recompute; each layer copied them again before, with a host sync each."""
    key = (id(layout), tuple(weights), str(device))
    hit = _ROWS.get(key)
    if hit is not None and hit[0] is layout:
        _ROWS.move_to_end(key)
        return hit[1]
    valid = layout.valid.to(torch.bool)
    kept = valid.nonzero().view(-1)  # on the host: the layout's tensors are host tensors
    host = (layout.seq_ids, valid, torch.tensor(layout.seq_lengths, dtype=torch.float32),
            torch.tensor(tuple(weights), dtype=torch.float32), kept, layout.seq_ids[kept])
    pin = device.type == "cuda"
    rows = TaskRows(*(t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)
                      for t in host))
    _ROWS[key] = (layout, rows)
    while len(_ROWS) > _ROWS_KEPT:
        _ROWS.popitem(last=False)
    return rows


def _rows(ctx: TaskContext, device: torch.device) -> TaskRows:
    weights = tuple(ctx.sequence_weights or ())
    if len(weights) != len(ctx.layout.seq_lengths):
        raise ValueError("router balancing loss: the task carries no loss weight per sequence "
                         "(TaskContext.sequence_weights); run it through PlanWork")
    return task_rows(ctx.layout, weights, device)


def sequence_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int,
                            ctx: TaskContext, coeff: float) -> torch.Tensor:
    """The Switch load-balancing loss of Hugging Face's MoE models (Mixtral, Qwen2/3-MoE:
    ``E * sum_e f_e P_e`` with the shares ``f`` of top-k assignments and mean probabilities ``P``
    over all MoE layers' rows together) computed per *sequence* of the task, from this rank's
    shard (``router_logits``: one ``[T_local, E]`` per MoE layer, rows in the shard's order).

    Returns this rank's part of ``coeff * sum_s w_s * targets_s * aux_s`` (``w_s``: the
    sequence's token loss weight, ``targets_s = n_s - 1``): summed over the ranks of the task it
    is the loss of each whole sequence weighted by its target tokens, which for a batch of one
    sequence is HF's own ``loss + router_aux_loss_coef * aux_loss`` times its token share.
    Collective over the task's group (the expert counts of its sequences)."""
    if not router_logits:
        raise ValueError("router balancing loss: no router logits (a model without MoE layers?)")
    device = router_logits[0].device
    rows_ = _rows(ctx, device)
    seq_ids, keep, lengths, weights = rows_.kept_seq_ids, rows_.kept, rows_.lengths, \
        rows_.weights
    experts = router_logits[0].shape[-1]
    counts = torch.zeros(len(lengths), experts, device=device)
    probs = torch.zeros(len(lengths), experts, device=device)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1).index_select(0, keep)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices
        hits = torch.zeros_like(p).scatter_(1, chosen, 1.0)
        counts.index_add_(0, seq_ids, hits)
        probs = probs.index_add(0, seq_ids, p)
    if ctx.group is not None:  # the other pieces of the task's sequences
        dist.all_reduce(counts, group=ctx.group)
    rows = len(router_logits) * lengths  # rows of a whole sequence over all MoE layers
    aux = experts * (counts * probs).sum(-1) / rows.square()
    return coeff * (weights * (lengths - 1).clamp(min=0) * aux).sum()
