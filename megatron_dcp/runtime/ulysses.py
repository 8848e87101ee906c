"""Ulysses all-to-all between sequence sharding and head sharding (differentiable).

Before: every rank of a Ulysses group of ``u`` ranks holds all heads of its ``T`` tokens.
After: it holds ``H / u`` heads (the slice of its Ulysses index) of the ``u * T`` tokens of the
whole group, in source order (Ulysses peer 0's tokens, then peer 1's, ...): the row order that
`megatron_dcp.runtime.layout.ShardLayout.portion` describes. All blocks have the same size.

A process group orders its ranks by global rank, which need not be the task's Ulysses order;
`UlyssesComm` maps between the two so that any rank order of a task works.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


class UlyssesComm:
    """A Ulysses group: its process group and the global ranks in Ulysses order."""

    def __init__(self, group, ulysses_ranks: Sequence[int]) -> None:
        self.group = group
        self.size = len(ulysses_ranks)
        pg_ranks = dist.get_process_group_ranks(group)
        if sorted(pg_ranks) != sorted(ulysses_ranks):
            raise ValueError(f"Ulysses group ranks {pg_ranks} differ from the task's Ulysses "
                             f"sub-group {tuple(ulysses_ranks)}")
        # block of process-group rank p <-> Ulysses index to_uly[p]
        self.to_uly = [list(ulysses_ranks).index(r) for r in pg_ranks]
        self.to_pg = [pg_ranks.index(r) for r in ulysses_ranks]
        self.identity = self.to_uly == list(range(self.size))

    def exchange(self, blocks: torch.Tensor) -> torch.Tensor:
        """All-to-all of ``blocks [u, ...]``: block ``i`` goes to Ulysses index ``i``; the result's
        block ``i`` came from Ulysses index ``i``."""
        if not self.identity:
            blocks = blocks[self.to_uly]
        blocks = blocks.contiguous()
        recv = torch.empty_like(blocks)
        dist.all_to_all_single(recv, blocks, group=self.group)
        return recv if self.identity else recv[self.to_pg]


def seq_to_head(comm: UlyssesComm, x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` (all heads of my tokens) -> ``[u * T, H / u, D]`` (my heads, group tokens)."""
    t, h, d = x.shape
    u = comm.size
    blocks = x.reshape(t, u, h // u, d).transpose(0, 1)  # block i: heads of Ulysses index i
    return comm.exchange(blocks).reshape(u * t, h // u, d)


def head_to_seq(comm: UlyssesComm, y: torch.Tensor) -> torch.Tensor:
    """Inverse of `seq_to_head`: ``[u * T, H / u, D]`` -> ``[T, H, D]``."""
    ut, hu, d = y.shape
    u = comm.size
    blocks = y.reshape(u, ut // u, hu, d)  # block i: tokens of Ulysses index i
    return comm.exchange(blocks).transpose(0, 1).reshape(ut // u, u * hu, d)


class SeqToHeadQKV(torch.autograd.Function):
    """`seq_to_head` of q, k and v in one all-to-all (their heads may differ: GQA)."""

    @staticmethod
    def forward(ctx, comm: UlyssesComm, q, k, v):
        u = comm.size
        t, d = q.shape[0], q.shape[2]
        heads = (q.shape[1] // u, k.shape[1] // u, v.shape[1] // u)
        ctx.comm, ctx.heads = comm, heads
        # Blocks [u, T, sum(heads), D] built in place by the cat; no reference to them is kept,
        # so the exchange frees them (long sequences: every copy here is a hidden vector a token).
        recv = comm.exchange(torch.cat([x.reshape(t, u, hx, d).transpose(0, 1)
                                        for x, hx in zip((q, k, v), heads)], dim=2))
        return tuple(part.contiguous() for part in recv.reshape(u * t, sum(heads), d)
                     .split(heads, dim=1))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        comm, heads = ctx.comm, ctx.heads
        ref = next(g for g in (dq, dk, dv) if g is not None)
        grads = [g if g is not None else ref.new_zeros(ref.shape[0], hx, ref.shape[2])
                 for g, hx in zip((dq, dk, dv), heads)]
        del dq, dk, dv, ref  # each copy below frees what it was made from (see forward)
        u = comm.size
        ut, d = grads[0].shape[0], grads[0].shape[2]
        flat = torch.cat(grads, dim=1).reshape(u, ut // u, sum(heads), d)
        grads.clear()
        back = comm.exchange(flat)  # [u, T, sum(h), D]
        del flat
        parts = back.split(heads, dim=2)
        del back
        return (None, *(p.transpose(0, 1).reshape(ut // u, u * hx, d)
                        for p, hx in zip(parts, heads)))


class HeadToSeq(torch.autograd.Function):
    """`head_to_seq` whose backward is `seq_to_head`."""

    @staticmethod
    def forward(ctx, comm: UlyssesComm, y):
        ctx.comm = comm
        return head_to_seq(comm, y)

    @staticmethod
    def backward(ctx, grad):
        return None, seq_to_head(ctx.comm, grad.contiguous())
