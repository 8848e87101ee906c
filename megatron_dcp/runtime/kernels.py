"""Local attention kernels over packed tokens with per-token positions and sequence ids.

Two kinds of kernel:

* **Block kernels** (`block_forward`, `block_backward`): exact torch attention of a set of query
  tokens against one block of key/value tokens, returning ``(out, lse)``; the backward takes the
  *final* merged ``out`` and ``lse`` of all blocks and returns this block's ``dq, dk, dv``
  (``P = exp(S * scale - lse)``, ``D = rowsum(dout * out)``, ``dS = P * (dP - D)``). Ring
  attention is built from these. They run on any device and dtype (half inputs are computed in
  float32).
* **Local attention** (`local_attention`): attention of a token set with itself, differentiable
  through autograd. Backends: ``"flash"`` (flash-attn's ``flash_attn_varlen_func``; CUDA, half
  precision), ``"sdpa"`` (torch ``scaled_dot_product_attention``, one call per sequence) and
  ``"torch"`` (the exact kernel). The backend is chosen once per process from what is available
  (`selected_backend`); a call that the chosen backend cannot do exactly (tokens of a sequence
  not at positions 0..n-1, attention groups for flash, float32 for flash) falls back to the next
  one, so results never depend on the choice beyond rounding.

A query token sees key token ``k`` iff both are valid (not padding), they belong to the same
sequence, ``pos_k <= pos_q`` when causal, and their attention-group ids match when given.
A query that sees no key (padding) gets output 0 and ``lse = -inf``.

Shapes: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: query head ``h``
uses key head ``h // (Hq // Hkv)``); ``lse [Tq, Hq]``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from megatron_dcp.runtime import pairs as _pairs_mod
from megatron_dcp.runtime.layout import TokenMeta

SCORE_BLOCK = 1 << 20
"""Score elements per dense block of the exact kernels (query rows x keys x heads): bounds their
memory and keeps every elementwise pass over the scores inside the CPU caches."""

try:  # optional: never required, only used on CUDA for half precision
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_varlen = None

_SELECTED: Optional[str] = None
_FORCED: ContextVar[Optional[str]] = ContextVar("megatron_dcp_attention_backend", default=None)
BACKENDS = ("flash", "sdpa", "torch")


def selected_backend() -> str:
    """The local-attention backend of this process (decided once, from what is available)."""
    global _SELECTED
    forced = _FORCED.get()
    if forced is not None:
        return forced
    if _SELECTED is None:
        if _flash_varlen is not None and torch.cuda.is_available():
            _SELECTED = "flash"
        elif hasattr(F, "scaled_dot_product_attention"):
            _SELECTED = "sdpa"
        else:
            _SELECTED = "torch"
    return _SELECTED


@contextmanager
def forced_backend(name: str) -> Iterator[None]:
    """Use backend ``name`` inside the block (tests and benchmarks compare backends)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {BACKENDS}")
    if name == "flash" and _flash_varlen is None:
        raise ValueError("attention backend 'flash' requested but flash_attn is not installed")
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the exact kernels compute and merge in (float64 stays, everything else float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_groups(group_of_position: Optional[Callable], meta: TokenMeta
                     ) -> Optional[torch.Tensor]:
    """Attention-group id of every token of ``meta`` (``None`` when no grouping is used)."""
    if group_of_position is None:
        return None
    groups = group_of_position(meta.positions)
    if not isinstance(groups, torch.Tensor) or groups.shape != meta.positions.shape:
        raise ValueError("group_of_position must map a LongTensor of positions to a tensor of "
                         "group ids of the same shape")
    return groups


# ---------------------------------------------------------------------- exact block kernels
def _rows_by_seq(meta: TokenMeta) -> dict[int, torch.Tensor]:
    """Indices of the valid tokens of each sequence id."""
    idx = torch.nonzero(meta.valid, as_tuple=True)[0]
    seq = meta.seq_ids[idx]
    order = torch.argsort(seq, stable=True)
    idx, seq = idx[order], seq[order]
    ids, counts = torch.unique_consecutive(seq, return_counts=True)
    return dict(zip(ids.tolist(), torch.split(idx, counts.tolist())))


def _chunks(q_meta: TokenMeta, k_meta: TokenMeta, causal: bool, heads: int):
    """(query rows, key rows) of every query chunk of every sequence present in both sets."""
    q_rows, k_rows = _rows_by_seq(q_meta), _rows_by_seq(k_meta)
    for s, qi in q_rows.items():
        ki = k_rows.get(s)
        if ki is None:
            continue
        rows = max(16, SCORE_BLOCK // (heads * ki.numel()))
        for qc in torch.split(qi, rows):
            kc = ki
            if causal:  # keys after the chunk's last query are invisible: skip them
                kc = ki[k_meta.positions[ki] <= q_meta.positions[qc].max()]
                if kc.numel() == 0:
                    continue
            yield qc, kc


def _scores(q, k, qc, kc, q_meta, k_meta, q_groups, k_groups, causal, scale, cdt):
    """Masked scores ``[Hkv, G, n, m]`` of query rows ``qc`` against key rows ``kc``."""
    hkv = k.shape[1]
    qs = q[qc].to(cdt).unflatten(1, (hkv, -1))  # [n, Hkv, G, D]
    ks = k[kc].to(cdt)
    s = torch.einsum("nhgd,mhd->hgnm", qs, ks) * scale
    mask = None
    if causal:
        mask = k_meta.positions[kc][None, :] <= q_meta.positions[qc][:, None]
    if q_groups is not None:
        same = k_groups[kc][None, :] == q_groups[qc][:, None]
        mask = same if mask is None else mask & same
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return qs, s


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(s - lse)`` with rows of ``lse = -inf`` (nothing visible) giving 0."""
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe[..., None])


def _fused_pairs(q, q_meta, k_meta, causal, q_groups):
    """Run pairs for the fused kernel when this process uses one and the block allows it."""
    if (q_groups is not None or selected_backend() == "torch" or not _pairs_mod.available(q.device)
            or q.dtype not in (torch.float32, torch.float64, torch.bfloat16)):
        return None
    return _pairs_mod.run_pairs(q_meta, k_meta, causal)


def block_forward(q, k, v, q_meta: TokenMeta, k_meta: TokenMeta, *, causal: bool, scale: float,
                  q_groups=None, k_groups=None):
    """Exact attention of ``q`` against one K/V block: ``(out, lse)`` in the compute dtype.

    Differentiable through autograd too, but `ExactAttention` (its backward is `block_backward`)
    keeps only ``out`` and ``lse`` instead of every probability block.
    """
    cdt = compute_dtype(q.dtype)
    if not torch.is_grad_enabled():  # the fused kernel has no autograd: only inside Functions
        pairs = _fused_pairs(q, q_meta, k_meta, causal, q_groups)
        if pairs is not None:
            return _pairs_mod.pair_forward(q, k, v, pairs, scale, cdt)
    tq, hq, dim = q.shape
    rows, outs, lses = [], [], []
    for qc, kc in _chunks(q_meta, k_meta, causal, q.shape[1]):
        _, s = _scores(q, k, qc, kc, q_meta, k_meta, q_groups, k_groups, causal, scale, cdt)
        lse = torch.logsumexp(s, dim=-1)  # [Hkv, G, n]
        p = _probs(s, lse)
        o = torch.einsum("hgnm,mhd->nhgd", p, v[kc].to(cdt))
        rows.append(qc)
        outs.append(o.reshape(qc.numel(), hq, dim))
        lses.append(lse.flatten(0, 1).transpose(0, 1))
    out = q.new_zeros((tq, hq, dim), dtype=cdt)
    lse = q.new_full((tq, hq), float("-inf"), dtype=cdt)
    if rows:
        idx = torch.cat(rows)
        out = out.index_copy(0, idx, torch.cat(outs))
        lse = lse.index_copy(0, idx, torch.cat(lses))
    return out, lse


def block_backward(dout, q, k, v, out, lse, q_meta: TokenMeta, k_meta: TokenMeta, *,
                   causal: bool, scale: float, q_groups=None, k_groups=None, delta=None):
    """``dq, dk, dv`` (compute dtype) of one K/V block, from the final merged ``out`` and ``lse``.

    ``delta`` (``rowsum(dout * out)``, ``[Tq, Hq]``) may be passed to avoid recomputing it for
    every block.
    """
    cdt = compute_dtype(q.dtype)
    pairs = _fused_pairs(q, q_meta, k_meta, causal, q_groups)
    if pairs is not None:
        return _pairs_mod.pair_backward(dout, q, k, v, out, lse, pairs, scale, cdt)
    hkv = k.shape[1]
    if delta is None:
        delta = (dout.to(cdt) * out.to(cdt)).sum(-1)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
    for qc, kc in _chunks(q_meta, k_meta, causal, q.shape[1]):
        qs, s = _scores(q, k, qc, kc, q_meta, k_meta, q_groups, k_groups, causal, scale, cdt)
        n = qc.numel()
        lse_c = lse[qc].to(cdt).transpose(0, 1).unflatten(0, (hkv, -1))  # [Hkv, G, n]
        p = _probs(s, lse_c)
        dos = dout[qc].to(cdt).unflatten(1, (hkv, -1))  # [n, Hkv, G, D]
        vs = v[kc].to(cdt)
        dp = torch.einsum("nhgd,mhd->hgnm", dos, vs)
        d_c = delta[qc].to(cdt).transpose(0, 1).unflatten(0, (hkv, -1))
        ds = p * (dp - d_c[..., None])
        dq.index_add_(0, qc, (torch.einsum("hgnm,mhd->nhgd", ds, k[kc].to(cdt)) * scale)
                      .reshape(n, -1, q.shape[2]))
        dk.index_add_(0, kc, torch.einsum("hgnm,nhgd->mhd", ds, qs) * scale)
        dv.index_add_(0, kc, torch.einsum("hgnm,nhgd->mhd", p, dos))
    return dq, dk, dv


def merge_block(out, lse, blk_out, blk_lse):
    """Log-sum-exp merge of a partial result with one more block's ``(out, lse)``."""
    if out is None:
        return blk_out, blk_lse
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    merged = out * torch.exp(lse - safe)[..., None] + blk_out * torch.exp(blk_lse - safe)[..., None]
    return merged, new


class ExactAttention(torch.autograd.Function):
    """Exact local attention whose backward recomputes probabilities from ``lse`` (saves memory)."""

    @staticmethod
    def forward(ctx, q, k, v, meta: TokenMeta, causal: bool, scale: float, groups):
        out, lse = block_forward(q, k, v, meta, meta, causal=causal, scale=scale, q_groups=groups,
                                 k_groups=groups)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.causal, ctx.scale, ctx.groups = meta, causal, scale, groups
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, ctx.meta, ctx.meta, causal=ctx.causal,
                                    scale=ctx.scale, q_groups=ctx.groups, k_groups=ctx.groups)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


# ---------------------------------------------------------------------- local attention
def _varlen_order(meta: TokenMeta):
    """Valid tokens sorted by (sequence, position) and their cu_seqlens, or ``None``.

    ``None`` when some sequence's tokens are not exactly positions 0..n-1 (then a dense
    per-sequence causal kernel would be wrong and the exact kernel is used).
    """
    cache = meta.cache
    if "varlen" not in cache:
        idx = torch.nonzero(meta.valid, as_tuple=True)[0]
        pos, seq = meta.positions[idx], meta.seq_ids[idx]
        key = seq * (int(pos.max()) + 1 if pos.numel() else 1) + pos
        order = torch.argsort(key)
        idx, pos, seq = idx[order], pos[order], seq[order]
        _, counts = torch.unique_consecutive(seq, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        expected = torch.arange(idx.numel(), device=idx.device) - torch.repeat_interleave(
            starts, counts)
        ok = bool(torch.equal(pos, expected))
        cu = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)
        cache["varlen"] = (idx, cu, counts.tolist()) if ok else None
    return cache["varlen"]


def _sdpa(q, k, v, rows, counts, causal, scale, groups, positions):
    """torch SDPA, one call per sequence (masks only where attention groups are used)."""
    outs = []
    gqa = q.shape[1] // k.shape[1]
    for r in torch.split(rows, counts):
        # [1, H, n, D]: torch's fused CPU kernel takes only 4-D inputs (3-D falls back to the
        # unfused math path, 4x slower here).
        qs, ks, vs = (t[r].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if gqa > 1:  # repeat rather than enable_gqa: the math backend on CPU lacks it in old torch
            ks, vs = ks.repeat_interleave(gqa, 1), vs.repeat_interleave(gqa, 1)
        mask, is_causal = None, causal
        if groups is not None:
            g = groups[r]
            mask = g[None, :] == g[:, None]
            if causal:
                mask = mask & (positions[r][None, :] <= positions[r][:, None])
            is_causal = False
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=is_causal,
                                                   scale=scale)[0].transpose(0, 1))
    return torch.cat(outs)


def local_attention(q, k, v, meta: TokenMeta, *, causal: bool = True,
                    softmax_scale: Optional[float] = None, groups: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
    """Attention of the tokens of ``meta`` among themselves (differentiable); ``out [T, Hq, D]``.

    ``groups`` (attention-group id per token) further restricts attention to equal ids.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = selected_backend()
    varlen = _varlen_order(meta) if backend != "torch" else None
    if backend == "flash" and (varlen is None or groups is not None or q.device.type != "cuda"
                               or q.dtype not in (torch.float16, torch.bfloat16)):
        backend = "sdpa"
    if varlen is None:
        backend = "torch"
    if backend == "torch":
        return ExactAttention.apply(q, k, v, meta, causal, scale, groups)
    rows, cu, counts = varlen
    if rows.numel() == 0:
        return q.new_zeros(q.shape)
    if backend == "flash":
        qs, ks, vs = (t.index_select(0, rows) for t in (q, k, v))
        o = _flash_varlen(qs, ks, vs, cu, cu, max(counts), max(counts), dropout_p=0.0,
                          softmax_scale=scale, causal=causal)
    else:
        o = _sdpa(q, k, v, rows, counts, causal, scale, groups, meta.positions)
    return q.new_zeros(q.shape).index_copy(0, rows, o.to(q.dtype))
