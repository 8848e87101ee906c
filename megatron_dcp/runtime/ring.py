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

from megatron_dcp.runtime.backends import deterministic as _deterministic
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
                scale: float, deterministic: bool):
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
        # Saved as returned, in q's dtype (what the flash backward reads, and what the next
        # layer keeps anyway): no float32 copy of the merged output lives until backward.
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.metas, ctx.causal, ctx.scale, ctx.groups = comm, metas, causal, scale, groups
        ctx.backend, ctx.deterministic = backend, deterministic
        return out

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
                                              backend=ctx.backend,
                                              deterministic=ctx.deterministic)
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
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None,
                None)


def ring_attention(q, k, v, comm: RingComm, metas: list[TokenMeta],
                   groups: Optional[list[Optional[torch.Tensor]]] = None, *, causal: bool,
                   scale: float, deterministic: Optional[bool] = None) -> torch.Tensor:
    """Ring attention over ``comm``.

    ``metas[j]`` describes the tokens of ring rank ``j``; ``groups[j]`` (optional) their
    attention-group ids (`megatron_dcp.runtime.kernels.attention_groups`). ``deterministic``:
    a deterministic backward (default: torch's setting, read now).
    """
    groups = groups if groups is not None else [None] * len(metas)
    return RingAttention.apply(q, k, v, comm, metas, groups, causal, scale,
                               _deterministic(deterministic))


class _Portions:
    """Where each ring rank's tokens lie in packed ``[N, H, D]`` tensors (`ring_in_one_process`).

    ``take`` gathers ring rank ``j``'s rows of head slice ``i`` (invalid rows zero), ``put``
    scatters them back. Index tensors are built on the host and uploaded once: no device reads
    inside the loop.
    """

    def __init__(self, lengths, ulysses: int, ring: int, device, group_of_position, blocks):
        from megatron_dcp.runtime.layout import ShardLayout

        self.metas = [ShardLayout.build(lengths, ulysses, ring, 0).portion(j) for j in range(ring)]
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        rows = [torch.where(m.valid, offsets[m.seq_ids] + m.positions, 0) for m in self.metas]
        self.kept = [(rows[j][m.valid].to(device), torch.nonzero(m.valid)[:, 0].to(device))
                     for j, m in enumerate(self.metas)]
        self.rows = [r.to(device) for r in rows]
        self.valid = [m.valid.to(device)[:, None, None] for m in self.metas]
        self.groups = [blocks.attention_groups(group_of_position, m) for m in self.metas]

    def take(self, x, j: int, i: int, h: int):
        """Ring rank ``j``'s rows of head slice ``i`` (``h`` heads wide) of packed ``x``."""
        y = x[self.rows[j], i * h:(i + 1) * h]
        return torch.where(self.valid[j], y, torch.zeros_like(y))

    def put(self, target, j: int, i: int, h: int, x) -> None:
        """Write ring rank ``j``'s valid rows ``x`` into head slice ``i`` of packed ``target``."""
        target[self.kept[j][0], i * h:(i + 1) * h] = x[self.kept[j][1]].to(target.dtype)


def _rank_forward(blocks, p: _Portions, j: int, qj, ks, vs, *, causal: bool, scale: float):
    """Ring rank ``j``'s output and LSE: its blocks merged in ring order."""
    out = lse = None
    for src in range(len(ks)):
        o, l = blocks.block_forward(qj, ks[src], vs[src], p.metas[j], p.metas[src],
                                    causal=causal, scale=scale, q_groups=p.groups[j],
                                    k_groups=p.groups[src])
        out, lse = blocks.merge_block(out, lse, o, l)
    return out, lse


def _rank_backward(blocks, p: _Portions, j: int, dout_j, qj, ks, vs, out, lse, dks, dvs, *,
                   causal: bool, scale: float):
    """Ring rank ``j``'s dQ; adds its share of every block's dK/dV to ``dks``/``dvs``."""
    dq = torch.zeros_like(out)
    for src in range(len(ks)):
        a, b, c = blocks.block_backward(dout_j, qj, ks[src], vs[src], out, lse, p.metas[j],
                                        p.metas[src], causal=causal, scale=scale,
                                        q_groups=p.groups[j], k_groups=p.groups[src])
        dq += a
        dks[src] += b
        dvs[src] += c
    return dq


def ring_in_one_process(q, k, v, lengths, ulysses: int, ring: int, *, causal: bool, scale: float,
                        dout=None, group_of_position=None, blocks=None):
    """A whole ``ulysses x ring`` task's attention computed in one process (benchmarks, checks).

    Packed inputs ``q [N, Hq, D]``, ``k, v [N, Hkv, D]`` of sequences ``lengths``. Every ring rank
    merges its blocks in ring order as `RingAttention` does; Ulysses rank ``i`` works on head
    slice ``i``. Returns packed ``[out]``, plus ``dq, dk, dv`` for upstream gradient ``dout``.
    ``blocks``: a module with ``block_forward``, ``block_backward``, ``merge_block`` and
    ``attention_groups`` (default: `megatron_dcp.runtime.kernels`).
    """
    from megatron_dcp.runtime import kernels

    mod = blocks or kernels
    p = _Portions(lengths, ulysses, ring, q.device, group_of_position, mod)
    hq, hkv = q.shape[1] // ulysses, k.shape[1] // ulysses
    results = [torch.zeros_like(t) for t in ((q,) if dout is None else (q, q, k, v))]
    with torch.no_grad():
        for i in range(ulysses):
            ks = [p.take(k, j, i, hkv) for j in range(ring)]
            vs = [p.take(v, j, i, hkv) for j in range(ring)]
            dks, dvs = [torch.zeros_like(x) for x in ks], [torch.zeros_like(x) for x in vs]
            for j in range(ring):
                qj = p.take(q, j, i, hq)
                out, lse = _rank_forward(mod, p, j, qj, ks, vs, causal=causal, scale=scale)
                p.put(results[0], j, i, hq, out)
                if dout is None:
                    continue
                dq = _rank_backward(mod, p, j, p.take(dout, j, i, hq), qj, ks, vs, out, lse, dks,
                                    dvs, causal=causal, scale=scale)
                p.put(results[1], j, i, hq, dq)
            if dout is not None:
                for j in range(ring):
                    p.put(results[2], j, i, hkv, dks[j])
                    p.put(results[3], j, i, hkv, dvs[j])
    return results
