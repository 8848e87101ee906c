"""Ring attention: K/V blocks travel around the ring, partial results merge by log-sum-exp.

Ring rank ``j`` of ``r`` holds the queries of its portion (zigzag chunks ``j`` and ``2r-1-j`` of
every sequence, see `megatron_dcp.runtime.layout`). At step ``s`` it holds the K/V block of ring
rank ``(j - s) mod r``, attends to it (causality and sequence membership come from the block's
original positions and sequence ids, which every rank derives from the layout without any
communication), and passes the block on to ``j + 1`` while computing. The backward passes K/V
around again; the dK/dV of a block travels with it, each rank adding its share, and after ``r``
steps one last hop returns it to its owner. Works for any ring degree.

Peers are addressed by global rank (``P2POp`` takes global ranks), so the ring order is the
task's, whatever order the process group keeps its ranks in.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dcp.runtime.kernels import (block_backward, block_forward, compute_dtype,
                                          merge_block, resolve_backend)
from megatron_dcp.runtime.layout import TokenMeta

_TAG_KV, _TAG_DKV = 11, 12


class RingComm:
    """Ring neighbours (global ranks) of this rank in a ring given in ring order."""

    def __init__(self, group, ring_ranks: Sequence[int], ring_rank: int) -> None:
        self.group = group
        self.size = len(ring_ranks)
        self.rank = ring_rank
        self.next = ring_ranks[(ring_rank + 1) % self.size]
        self.prev = ring_ranks[(ring_rank - 1) % self.size]

    def shift(self, x: torch.Tensor, tag: int):
        """Start sending ``x`` to the next rank and receiving its like from the previous.

        Returns ``(works, buffer)``; wait on every work before reading ``buffer``.
        """
        buf = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, self.next, self.group, tag),
               dist.P2POp(dist.irecv, buf, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops), buf


def _wait(works) -> None:
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """Exact ring attention of this rank's queries over the K/V of the whole ring portion set."""

    @staticmethod
    def forward(ctx, q, k, v, comm: RingComm, metas: list, groups: list, causal: bool,
                scale: float):
        j, r, hkv = comm.rank, comm.size, k.shape[1]
        # Chosen here and kept: CUDA runs backward on a thread that does not see forced_backend.
        backend = resolve_backend(q)
        kv = torch.cat([k, v], dim=1).contiguous()
        out = lse = None
        for step in range(r):
            pending = comm.shift(kv, _TAG_KV) if step < r - 1 else None
            src = (j - step) % r
            k_blk, v_blk = kv.split([hkv, hkv], dim=1)
            blk_out, blk_lse = block_forward(q, k_blk, v_blk, metas[j], metas[src], causal=causal,
                                             scale=scale, q_groups=groups[j],
                                             k_groups=groups[src], backend=backend)
            out, lse = merge_block(out, lse, blk_out, blk_lse)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.metas, ctx.causal, ctx.scale, ctx.groups = comm, metas, causal, scale, groups
        ctx.backend = backend
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, metas, groups = ctx.comm, ctx.metas, ctx.groups
        j, r, hkv = comm.rank, comm.size, k.shape[1]
        dq = torch.zeros(q.shape, dtype=compute_dtype(q.dtype), device=q.device)
        kv = torch.cat([k, v], dim=1).contiguous()
        dkv = None
        dkv_pending = None
        for step in range(r):
            kv_pending = comm.shift(kv, _TAG_KV) if step < r - 1 else None
            src = (j - step) % r
            k_blk, v_blk = kv.split([hkv, hkv], dim=1)
            dq_b, dk_b, dv_b = block_backward(dout, q, k_blk, v_blk, out, lse, metas[j],
                                              metas[src], causal=ctx.causal, scale=ctx.scale,
                                              q_groups=groups[j], k_groups=groups[src],
                                              backend=ctx.backend)
            dq += dq_b
            contrib = torch.cat([dk_b, dv_b], dim=1)
            if dkv_pending is not None:  # the accumulator of block src, from the previous rank
                _wait(dkv_pending[0])
                dkv = dkv_pending[1] + contrib
            else:
                dkv = contrib
            if r > 1:
                dkv_pending = comm.shift(dkv.contiguous(), _TAG_DKV)
            if kv_pending is not None:
                _wait(kv_pending[0])
                kv = kv_pending[1]
        if dkv_pending is not None:  # the last hop brings back this rank's own dK/dV
            _wait(dkv_pending[0])
            dkv = dkv_pending[1]
        dk, dv = dkv.split([hkv, hkv], dim=1)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None)


def ring_attention(q, k, v, comm: RingComm, metas: list[TokenMeta],
                   groups: Optional[list[Optional[torch.Tensor]]] = None, *, causal: bool,
                   scale: float) -> torch.Tensor:
    """Ring attention over ``comm``.

    ``metas[j]`` describes the tokens of ring rank ``j``; ``groups[j]`` (optional) their
    attention-group ids (`megatron_dcp.runtime.kernels.attention_groups`).
    """
    groups = groups if groups is not None else [None] * len(metas)
    return RingAttention.apply(q, k, v, comm, metas, groups, causal, scale)
