"""Attention blocks as dense run pairs, for fused kernels that return log-sum-exp.

Within one sequence, the query tokens of a block (sorted by position) form a few *runs* of
consecutive positions, and so do the key tokens. With the zigzag layout every (query run, key
run) pair of a causal block is one of three kinds: *full* (every key before every query),
*diagonal* (the same positions: plain causal attention) or *empty* (every key after every
query). A fused dense kernel (torch's CPU flash-attention op here; flash-attn's on GPU would fit
the same place) then computes each non-empty pair, and pairs of the same queries are merged by
log-sum-exp. The backward gives every pair the *final* merged ``out`` and ``lse``, which is what
such kernels' backward expects (``D = rowsum(dout * out)``, ``P = exp(S - lse)``).

Token sets that do not decompose this way (partial overlaps) return ``None`` and the caller uses
the exact kernel. Attention groups (video) always use the exact kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dcp.runtime.layout import TokenMeta

_CPU_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def available(device: torch.device) -> bool:
    """Whether a fused pair kernel exists for ``device`` (CPU only for now)."""
    return device.type == "cpu" and _CPU_FWD is not None and _CPU_BWD is not None


def _runs(meta: TokenMeta) -> dict[int, list[tuple[int, int, torch.Tensor]]]:
    """Per sequence id: runs ``(first position, end position, rows)`` of valid tokens."""
    if "runs" in meta.cache:
        return meta.cache["runs"]
    idx = torch.nonzero(meta.valid, as_tuple=True)[0]
    pos, seq = meta.positions[idx], meta.seq_ids[idx]
    order = torch.argsort(seq * (int(pos.max()) + 1 if pos.numel() else 1) + pos)
    idx, pos, seq = idx[order], pos[order], seq[order]
    breaks = torch.ones(idx.numel(), dtype=torch.bool)
    if idx.numel() > 1:
        breaks[1:] = (seq[1:] != seq[:-1]) | (pos[1:] != pos[:-1] + 1)
    starts = torch.nonzero(breaks, as_tuple=True)[0].tolist() + [idx.numel()]
    runs: dict[int, list] = {}
    for a, b in zip(starts[:-1], starts[1:]):
        runs.setdefault(int(seq[a]), []).append((int(pos[a]), int(pos[b - 1]) + 1, idx[a:b]))
    meta.cache["runs"] = runs
    return runs


def run_pairs(q_meta: TokenMeta, k_meta: TokenMeta, causal: bool
              ) -> Optional[list[tuple[torch.Tensor, torch.Tensor, bool]]]:
    """``(query rows, key rows, diagonal)`` of every non-empty pair, or ``None`` if some pair
    overlaps partially. Cached on ``q_meta`` per ``(k_meta, causal)``."""
    cached = q_meta.cache.setdefault("pairs", [])
    for k_ref, c, pairs in cached:
        if k_ref is k_meta and c == causal:
            return pairs
    q_runs, k_runs = _runs(q_meta), _runs(k_meta)
    pairs: Optional[list] = []
    for s, qrs in q_runs.items():
        for qa, qb, qrows in qrs:
            for ka, kb, krows in k_runs.get(s, []):
                if not causal or kb <= qa:
                    pairs.append((qrows, krows, False))
                elif ka >= qb:
                    continue
                elif (ka, kb) == (qa, qb):
                    pairs.append((qrows, krows, True))
                else:
                    pairs = None
                    break
            if pairs is None:
                break
        if pairs is None:
            break
    cached.append((k_meta, causal, pairs))
    return pairs


def _heads_first(x: torch.Tensor, rows: torch.Tensor, rep: int, cdt) -> torch.Tensor:
    """``x[rows]`` as ``[1, H * rep, n, D]`` (key heads repeated for GQA)."""
    y = x[rows].to(cdt).transpose(0, 1)
    if rep > 1:
        y = y.repeat_interleave(rep, 0)
    return y.unsqueeze(0)


def pair_forward(q, k, v, pairs, scale: float, cdt):
    """``(out [Tq, Hq, D], lse [Tq, Hq])`` in ``cdt`` from the fused kernel over ``pairs``."""
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=cdt, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=cdt, device=q.device)
    for qr, kr, diag in pairs:
        o, l = _CPU_FWD(_heads_first(q, qr, 1, cdt), _heads_first(k, kr, rep, cdt),
                        _heads_first(v, kr, rep, cdt), 0.0, diag, scale=scale)
        o, l = o[0].transpose(0, 1), l[0].transpose(0, 1).to(cdt)
        old_o, old_l = out[qr], lse[qr]
        new_l = torch.logaddexp(old_l, l)
        safe = torch.where(torch.isinf(new_l), torch.zeros_like(new_l), new_l)
        out[qr] = old_o * torch.exp(old_l - safe)[..., None] + o * torch.exp(l - safe)[..., None]
        lse[qr] = new_l
    return out, lse


def pair_backward(dout, q, k, v, out, lse, pairs, scale: float, cdt):
    """``dq, dk, dv`` (``cdt``) of one K/V block from the final ``out`` and ``lse``."""
    hkv = k.shape[1]
    rep = q.shape[1] // hkv
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
    for qr, kr, diag in pairs:
        l = lse[qr].to(cdt).transpose(0, 1).unsqueeze(0).contiguous()
        g_q, g_k, g_v = _CPU_BWD(_heads_first(dout, qr, 1, cdt), _heads_first(q, qr, 1, cdt),
                                 _heads_first(k, kr, rep, cdt), _heads_first(v, kr, rep, cdt),
                                 _heads_first(out, qr, 1, cdt), l, 0.0, diag, scale=scale)
        dq.index_add_(0, qr, g_q[0].transpose(0, 1))
        dk.index_add_(0, kr, _fold_heads(g_k[0], hkv))
        dv.index_add_(0, kr, _fold_heads(g_v[0], hkv))
    return dq, dk, dv


def _fold_heads(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[Hkv * rep, m, D]`` gradient of repeated key heads -> ``[m, Hkv, D]`` (summed)."""
    return g.unflatten(0, (hkv, -1)).sum(1).transpose(0, 1)
