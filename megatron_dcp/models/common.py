"""Pieces shared by the reference models: RMSNorm, SwiGLU, rotary embedding, token losses, init.

Tensor names: ``T`` tokens (of the local shard inside a task), ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_dcp.config import IGNORE_INDEX
from megatron_dcp.plan.memory import loss_chunk_tokens
from megatron_dcp.runtime.context import TaskContext


NORM_CHUNK_TOKENS = 8192
"""Tokens whose fp32 temporaries `RMSNorm`'s backward holds at a time."""


class _RMSNormFunction(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` that saves for backward only ``x`` (which the
    layer keeps anyway) and the per-token ``rsqrt``, as a fused kernel does: autograd's own graph
    of the same expression saves the normalised product too, a hidden vector a token a norm
    (the memory model counts the fused norm: `megatron_dcp.plan.memory`)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return x * rstd * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        width = x.shape[-1]
        rows, grads, rstds = x.reshape(-1, width), grad.reshape(-1, width), rstd.reshape(-1, 1)
        work = torch.promote_types(x.dtype, torch.float32)
        w = weight.to(work)
        dx = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        dweight = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        for start in range(0, rows.shape[0], NORM_CHUNK_TOKENS):  # fp32 temporaries: a chunk's
            part = slice(start, start + NORM_CHUNK_TOKENS)
            g, r = grads[part].to(work), rstds[part].to(work)
            normed = rows[part].to(work) * r
            if dweight is not None:
                dweight += (g * normed).sum(0)
            if dx is not None:
                g = g * w
                dx[part] = r * (g - normed * (g * normed).mean(-1, keepdim=True))
        return (dx.view_as(x) if dx is not None else None,
                dweight.to(weight.dtype) if dweight is not None else None, None)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim of ``x``."""
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` that saves ``gate`` and ``up`` only, as a fused kernel does (autograd's
    graph of the same expression saves ``silu(gate)`` too: one more FFN-wide tensor a token a
    layer than the memory model counts). Forward and backward run the same operations as
    autograd's, so values and gradients are bitwise the same."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        dup = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        dgate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] \
            else None
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, saving for backward what a fused SwiGLU saves (`_SwiGLU`)."""
    return _SwiGLU.apply(gate, up)


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, 1, D]`` of rotary embedding at the given positions (not 0..T-1: a shard of
    a sequence holds positions from anywhere in it)."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, device=position_ids.device,
                                             dtype=torch.float64) / half))
    angles = position_ids.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (rotate-half convention)."""
    half = x_THD.shape[-1] // 2
    rotated = torch.cat([-x_THD[..., half:], x_THD[..., :half]], dim=-1)
    return x_THD * cos + rotated * sin


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Token losses computed ``chunk`` tokens at a time, in float32 (float64 stays).

    Saves the logits themselves and one log-sum-exp per token. Forward and backward each make
    one float32 tensor of a chunk at a time (logits minus their max or log-sum-exp: type
    promotion converts and subtracts in one kernel; the rest is in place), never a whole float32
    copy of the logits or of their softmax. The gradient is ``g * (softmax - one_hot(label))``,
    as torch's.
    """

    @staticmethod
    def forward(ctx, logits_TV, labels_T, chunk: int):
        cdt = torch.float64 if logits_TV.dtype == torch.float64 else torch.float32
        valid_T = labels_T != IGNORE_INDEX
        target_T1 = torch.where(valid_T, labels_T, 0)[:, None]
        lse_T = torch.empty(logits_TV.shape[0], dtype=cdt, device=logits_TV.device)
        picked_T = torch.empty_like(lse_T)
        for s in range(0, logits_TV.shape[0], chunk):
            x = logits_TV[s:s + chunk]
            top = x.amax(dim=-1).to(cdt)
            top = torch.where(torch.isfinite(top), top, 0.0)
            z = torch.sub(x, top[:, None])  # float32 (promoted), a new tensor
            lse_T[s:s + chunk] = z.exp_().sum(dim=-1).log_() + top
            picked_T[s:s + chunk] = x.gather(1, target_T1[s:s + chunk])[:, 0]
            del z
        ctx.save_for_backward(logits_TV, target_T1, valid_T, lse_T)
        ctx.chunk = chunk
        return torch.where(valid_T, lse_T - picked_T, 0.0)

    @staticmethod
    def backward(ctx, grad_T):
        logits_TV, target_T1, valid_T, lse_T = ctx.saved_tensors
        g_T1 = torch.where(valid_T, grad_T.to(lse_T.dtype), 0.0)[:, None]
        grad_TV = torch.empty_like(logits_TV)
        for s in range(0, logits_TV.shape[0], ctx.chunk):
            e = s + ctx.chunk
            # softmax in float32 (promoted), a new tensor: the saved logits stay intact
            p = torch.sub(logits_TV[s:e], lse_T[s:e, None]).exp_()
            p.mul_(g_T1[s:e]).scatter_add_(1, target_T1[s:e], -g_T1[s:e])
            grad_TV[s:e] = p
            del p
        return grad_TV, None, None


def token_losses(logits: torch.Tensor, labels: torch.Tensor,
                 chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Cross-entropy of every token ``[T]`` (0 where ``labels == -100``) of ``logits [T, V]``.

    Computed in float32 (float64 stays), ``chunk_tokens`` tokens at a time (default
    `megatron_dcp.plan.memory.loss_chunk_tokens`: 128 MiB of float32 logits), so a large vocabulary
    never holds a whole float32 copy of the logits or of their softmax: the loss path holds the
    logits, their gradient and a few chunks (`megatron_dcp.plan.memory.loss_bytes`, what the
    planner counts). Values and gradients are those of ``F.cross_entropy(logits.float(), ...)``.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"token_losses: logits [T, V] and labels [T], got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    chunk = int(chunk_tokens or loss_chunk_tokens(logits.shape[1]))
    return _ChunkedCrossEntropy.apply(logits, labels, max(1, chunk))


def check_positions(position_ids: torch.Tensor, max_position: Optional[int], model: str,
                    ctx: Optional[TaskContext] = None) -> None:
    """Raise a clear error when a position is beyond what the model supports.

    Inside a task (``ctx``) the positions are read from the task's layout, which lives on the
    host (no device sync), its padding left out (a ring layout pads a sequence past its length:
    those positions are never attended to nor scored); the error names the task and the sequence
    (global batch index).
    """
    if ctx is not None and ctx.layout is not None:
        position_ids = torch.where(ctx.layout.valid, ctx.layout.position_ids, 0)
    if max_position is None or position_ids.numel() == 0:
        return
    top = int(position_ids.max())
    if top < max_position:
        return
    where = ""
    if ctx is not None and ctx.layout is not None:
        at = int(torch.nonzero(position_ids == top)[0, 0])
        local_seq = int(ctx.layout.seq_ids[at])
        global_seq = ctx.task.seqs[local_seq]
        where = (f" in sequence {global_seq} (length {ctx.layout.seq_lengths[local_seq]}) "
                 f"of task {ctx.task.id}")
    raise ValueError(f"{model}: position {top}{where} is beyond max_position={max_position}; "
                     f"sequences may have at most {max_position} tokens")


def check_inputs(model: str, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                 task: Optional[TaskContext], max_position: Optional[int] = None
                 ) -> tuple[torch.Tensor, Optional[TaskContext]]:
    """The inputs of a token model's forward (``model`` names it in errors), checked:
    ``input_ids`` must be 1-D ``[T]`` (the local shard of a task, or one whole sequence).
    Returns ``position_ids`` (default ``0..T-1``: one whole sequence) and ``task`` (the task the
    model was called with; ``None``: outside a task); with ``max_position``, a position beyond
    it raises (`check_positions`)."""
    if input_ids.dim() != 1:
        raise ValueError(f"{model}: input_ids must be 1-D [tokens], got {tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[0], device=input_ids.device)
    if max_position is not None:
        check_positions(position_ids, max_position, model, task)
    return position_ids, task


def init_weights(module: nn.Module, std: float, seed: Optional[int]) -> None:
    """Normal(0, std) for every matrix and embedding, ones for norms; from ``seed`` if given
    (so every rank builds the same model without touching the global RNG)."""
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
