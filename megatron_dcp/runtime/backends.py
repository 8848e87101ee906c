"""Kernels that run one varlen call (`megatron_dcp.runtime.segments.Call`) of an attention block.

Each backend has a forward, returning this call's ``(out [Tq, Hq, D], lse [Tq, Hq])`` (rows the
call does not cover: 0 and -inf), and a backward that adds this call's ``dq, dk, dv`` into a
`Grads` from the *final* merged ``out`` and ``lse`` of the queries (``P = exp(S * scale - lse)``,
``D = rowsum(dout * out)``, ``dS = P * (dP - D)``), which is what the flash kernels' backward
computes. GQA is native everywhere (query head ``h`` uses key head ``h // (Hq // Hkv)``).

* ``flash``: flash-attn 2's ``_flash_attn_varlen_forward/backward`` (CUDA, fp16/bf16).
* ``torch_flash``: torch's own ``aten._flash_attention_forward/backward`` with cumulative
  lengths (CUDA sm80+, fp16/bf16). Both flash LSEs are ``[Hq, Tq]`` fp32.
* ``sdpa``: torch's fused CPU flash-attention op, one call per group of equal-shape segments.
* ``torch``: the exact chunked torch kernel (any device and dtype): reference and fallback.

Index tensors come from the host decomposition, uploaded once: nothing here reads a device value
back to the host.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Optional

import torch

from megatron_dcp.runtime.segments import Call

SCORE_BLOCK = 1 << 20
"""Score elements per dense block of the exact kernel (query rows x keys x heads): bounds its
memory and keeps every elementwise pass over the scores inside the CPU caches."""

_CPU_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_TORCH_FLASH_FWD = getattr(torch.ops.aten, "_flash_attention_forward", None)
_TORCH_FLASH_BWD = getattr(torch.ops.aten, "_flash_attention_backward", None)

try:  # optional: flash-attn 2, only used on CUDA in half precision
    import flash_attn
    from flash_attn.flash_attn_interface import (_flash_attn_varlen_backward as _FA_BWD,
                                                 _flash_attn_varlen_forward as _FA_FWD)

    # Older releases return a padded varlen LSE [B, H, max_q]; torch_flash serves them instead.
    if tuple(int(x) for x in flash_attn.__version__.split(".")[:2]) < (2, 6):
        _FA_FWD = _FA_BWD = None
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _FA_FWD = _FA_BWD = None

FLASH_ATTN_AVAILABLE = _FA_FWD is not None


class Grads:
    """Accumulates ``dq, dk, dv`` of a block; one call over all rows in order is kept as is."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> None:
        self.q_shape, self.k_shape, self.dtype, self.device = q.shape, k.shape, dtype, q.device
        self.whole: Optional[tuple] = None
        self.buffers: Optional[list[torch.Tensor]] = None

    def _materialize(self) -> None:
        if self.buffers is None:
            self.buffers = [torch.zeros(s, dtype=self.dtype, device=self.device)
                            for s in (self.q_shape, self.k_shape, self.k_shape)]
            if self.whole is not None:
                for buf, g in zip(self.buffers, self.whole):
                    buf += g
                self.whole = None

    def add(self, q_rows, dq, k_rows, dk, dv) -> None:
        """Add gradients of rows ``q_rows``/``k_rows`` (``None``: all rows, in order)."""
        if q_rows is None and k_rows is None and self.buffers is None and self.whole is None:
            self.whole = (dq, dk, dv)
            return
        self._materialize()
        dq_all, dk_all, dv_all = self.buffers
        for buf, rows, g in ((dq_all, q_rows, dq), (dk_all, k_rows, dk), (dv_all, k_rows, dv)):
            if rows is None:
                buf += g
            else:
                buf.index_add_(0, rows, g.reshape(-1, *buf.shape[1:]).to(self.dtype))

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``dq, dk, dv`` (zeros where no call contributed)."""
        if self.whole is not None:
            return self.whole
        self._materialize()
        return tuple(self.buffers)


def _take(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    return x.contiguous() if rows is None else x.index_select(0, rows)


def _scatter(rows, o, lse, q):
    """This call's rows written into ``[Tq, ...]`` tensors (0 and -inf elsewhere)."""
    if rows is None:
        return o, lse
    out = o.new_zeros((q.shape[0], *o.shape[1:])).index_copy_(0, rows, o)
    lse_all = lse.new_full((q.shape[0], lse.shape[1]), float("-inf")).index_copy_(0, rows, lse)
    return out, lse_all


# ---------------------------------------------------------------------------- exact kernel
def _exact_chunks(call: Call, device, heads: int):
    """``(query rows [b, n], key rows [b, m], first query index)`` blocks of at most
    ``SCORE_BLOCK`` scores; causal blocks drop the keys after their last query."""
    for q2, k2 in call.shapes(device):
        b, n = q2.shape
        m = k2.shape[1]
        per = max(1, SCORE_BLOCK // (heads * m))  # query rows per block
        if n <= per:
            step = max(1, per // n)
            for b0 in range(0, b, step):
                yield q2[b0:b0 + step], k2[b0:b0 + step], 0
        else:
            for b0 in range(b):
                for i0 in range(0, n, per):
                    i1 = min(n, i0 + per)
                    yield q2[b0:b0 + 1, i0:i1], k2[b0:b0 + 1, :i1 if call.causal else m], i0


def _exact_scores(q, k, qi, ki, i0, causal, scale, cdt):
    """``(q rows [b, n, Hkv, G, D], scores [b, Hkv, G, n, m])`` of one block, masked."""
    hkv = k.shape[1]
    qs = q[qi].to(cdt).unflatten(2, (hkv, -1))
    s = torch.einsum("bnhgd,bmhd->bhgnm", qs, k[ki].to(cdt)) * scale
    if causal:  # square segments: key j is visible to query i iff j <= i
        n, m = qi.shape[1], ki.shape[1]
        mask = (torch.arange(m, device=q.device)[None, :]
                <= torch.arange(i0, i0 + n, device=q.device)[:, None])
        s = s.masked_fill(~mask, float("-inf"))
    return qs, s


def exact_forward(call: Call, q, k, v, scale: float, cdt):
    """Exact forward of one call (computed in ``cdt``)."""
    tq, hq, dim = q.shape
    out = q.new_zeros((tq, hq, dim), dtype=cdt)
    lse = q.new_full((tq, hq), float("-inf"), dtype=cdt)
    for qi, ki, i0 in _exact_chunks(call, q.device, hq):
        _, s = _exact_scores(q, k, qi, ki, i0, call.causal, scale, cdt)
        l = torch.logsumexp(s, dim=-1)  # every segment row sees at least one key: finite
        o = torch.einsum("bhgnm,bmhd->bnhgd", torch.exp(s - l[..., None]), v[ki].to(cdt))
        rows = qi.reshape(-1)
        out.index_copy_(0, rows, o.reshape(-1, hq, dim))
        lse.index_copy_(0, rows, l.permute(0, 3, 1, 2).reshape(-1, hq))
    return out, lse


def exact_backward(call: Call, dout, q, k, v, out, lse, scale: float, cdt, grads: Grads,
                   delta: torch.Tensor) -> None:
    """Exact backward of one call; ``delta = rowsum(dout * out)`` ``[Tq, Hq]`` in ``cdt``."""
    hkv = k.shape[1]
    for qi, ki, i0 in _exact_chunks(call, q.device, q.shape[1]):
        qs, s = _exact_scores(q, k, qi, ki, i0, call.causal, scale, cdt)
        l = lse[qi].to(cdt).unflatten(2, (hkv, -1)).permute(0, 2, 3, 1)  # [b, Hkv, G, n]
        p = torch.exp(s - l[..., None])
        dos = dout[qi].to(cdt).unflatten(2, (hkv, -1))
        vs = v[ki].to(cdt)
        dp = torch.einsum("bnhgd,bmhd->bhgnm", dos, vs)
        d = delta[qi].unflatten(2, (hkv, -1)).permute(0, 2, 3, 1)
        ds = p * (dp - d[..., None])
        grads.add(qi.reshape(-1), torch.einsum("bhgnm,bmhd->bnhgd", ds, k[ki].to(cdt)) * scale,
                  ki.reshape(-1), torch.einsum("bhgnm,bnhgd->bmhd", ds, qs) * scale,
                  torch.einsum("bhgnm,bnhgd->bmhd", p, dos))


# ---------------------------------------------------------------------------- CPU fused op
def _cpu_batches(call: Call, q):
    """Equal-shape segment groups; one segment over all rows in order needs no gather."""
    if call.q_identity and call.k_identity and call.num_segments == 1:
        return [(None, None)]
    return call.shapes(q.device)


def _heads_first(x, rows, cdt):
    """``x[rows]`` ([B, n, H, D]) as ``[B, H, n, D]``, or all of ``x`` as one batch entry."""
    y = x.unsqueeze(0) if rows is None else x[rows]
    return y.to(cdt).transpose(1, 2)


def _rows_last(y):
    """``[B, H, n, ...]`` -> ``[B * n, H, ...]``."""
    return y.transpose(1, 2).reshape(-1, *y.shape[1:2], *y.shape[3:])


def cpu_forward(call: Call, q, k, v, scale: float, cdt):
    """Forward of one call with torch's fused CPU flash-attention op (computed in ``cdt``)."""
    parts = []
    for qr, kr in _cpu_batches(call, q):
        o, l = _CPU_FWD(_heads_first(q, qr, cdt), _heads_first(k, kr, cdt),
                        _heads_first(v, kr, cdt), 0.0, call.causal, scale=scale)
        parts.append((qr, _rows_last(o), _rows_last(l).to(cdt)))
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1], parts[0][2]
    out = q.new_zeros(q.shape, dtype=cdt)
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=cdt)
    for qr, o, l in parts:
        out.index_copy_(0, qr.reshape(-1), o)
        lse.index_copy_(0, qr.reshape(-1), l)
    return out, lse


def cpu_backward(call: Call, dout, q, k, v, out, lse, scale: float, cdt, grads: Grads) -> None:
    """Backward of one call with torch's fused CPU op."""
    for qr, kr in _cpu_batches(call, q):
        l = (lse.unsqueeze(0) if qr is None else lse[qr]).to(cdt).transpose(1, 2).contiguous()
        g_q, g_k, g_v = _CPU_BWD(_heads_first(dout, qr, cdt), _heads_first(q, qr, cdt),
                                 _heads_first(k, kr, cdt), _heads_first(v, kr, cdt),
                                 _heads_first(out, qr, cdt), l, 0.0, call.causal, scale=scale)
        flat = (None if qr is None else qr.reshape(-1), None if kr is None else kr.reshape(-1))
        grads.add(flat[0], _rows_last(g_q), flat[1], _rows_last(g_k), _rows_last(g_v))


# ---------------------------------------------------------------------------- flash (CUDA)
@lru_cache(maxsize=None)
def _device_state(device: torch.device):
    """Per-device constants of torch's flash backward (dropout is off: the RNG state is unused)."""
    return (torch.zeros((2,), dtype=torch.uint64, device=device),
            torch.empty(0, device=device))


@lru_cache(maxsize=None)
def _flash_attn_kwargs(fn, backward: bool) -> dict:
    """Keyword arguments of flash-attn's varlen functions beyond the common ones; their names
    changed between releases (``window_size`` became ``window_size_left/right`` in 2.7)."""
    try:
        params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    except (TypeError, ValueError):
        params = {}
    kw = {}
    if "window_size" in params:
        kw["window_size"] = (-1, -1)
    else:  # 2.7 and later, or a signature that tells nothing: assume the newest
        kw.update(window_size_left=-1, window_size_right=-1)
    if "softcap" in params or "window_size" not in params:
        kw["softcap"] = 0.0
    kw["alibi_slopes"] = None
    if backward:
        kw["deterministic"] = False
        kw["rng_state"] = None
    else:
        kw["return_softmax"] = False
    return kw


def _flash_call(name: str, qg, kg, vg, rows, call: Call, scale: float):
    """One varlen flash forward: ``(out [N, Hq, D], lse [Hq, N] fp32)``."""
    if name == "torch_flash":
        o, lse = _TORCH_FLASH_FWD(qg, kg, vg, rows.cu_q, rows.cu_k, call.max_q, call.max_k, 0.0,
                                  call.causal, False, scale=scale)[:2]
    else:
        res = _FA_FWD(qg, kg, vg, rows.cu_q, rows.cu_k, call.max_q, call.max_k, 0.0, scale,
                      call.causal, **_flash_attn_kwargs(_FA_FWD, False))
        o, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])  # < 2.7: 8 outputs
    if tuple(lse.shape) != (qg.shape[1], qg.shape[0]):
        raise RuntimeError(f"{name}: LSE of shape {tuple(lse.shape)}, expected [Hq, total_q] = "
                           f"{(qg.shape[1], qg.shape[0])} (flash-attn older than 2.5 pads it)")
    return o, lse


def flash_forward(name: str, call: Call, q, k, v, scale: float):
    """Forward of one call with a flash varlen kernel; ``out`` in the input dtype, LSE fp32."""
    rows = call.rows(q.device)
    o, lse = _flash_call(name, _take(q, rows.q), _take(k, rows.k), _take(v, rows.k), rows, call,
                         scale)
    # flash-attn marks rows that see no key with +inf; the merge expects -inf.
    lse = lse.masked_fill(lse == float("inf"), float("-inf")).t()
    return _scatter(rows.q, o, lse, q)


def flash_backward(name: str, call: Call, dout, q, k, v, out, lse, scale: float,
                   grads: Grads) -> None:
    """Backward of one call with a flash varlen kernel, from the final ``out`` and ``lse``."""
    rows = call.rows(q.device)
    qg, kg, vg = _take(q, rows.q), _take(k, rows.k), _take(v, rows.k)
    dog, og = _take(dout, rows.q).to(q.dtype), _take(out, rows.q).to(q.dtype)
    lse_g = lse if rows.q is None else lse.index_select(0, rows.q)
    lse_g = lse_g.float().t().contiguous()  # [Hq, N], as the kernels produce it
    if name == "torch_flash":
        rng, unused = _device_state(q.device)
        dq, dk, dv = _TORCH_FLASH_BWD(dog, qg, kg, vg, og, lse_g, rows.cu_q, rows.cu_k,
                                      call.max_q, call.max_k, 0.0, call.causal, rng, unused,
                                      scale=scale)
    else:
        dq, dk, dv = torch.empty_like(qg), torch.empty_like(kg), torch.empty_like(vg)
        _FA_BWD(dog, qg, kg, vg, og, lse_g, dq, dk, dv, rows.cu_q, rows.cu_k, call.max_q,
                call.max_k, 0.0, scale, call.causal, **_flash_attn_kwargs(_FA_BWD, True))
    grads.add(rows.q, dq, rows.k, dk, dv)


# ---------------------------------------------------------------------------- capabilities
@lru_cache(maxsize=None)
def _sm80(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def supports(name: str, q: torch.Tensor) -> bool:
    """Whether backend ``name`` can run attention on ``q``'s device, dtype and head size."""
    if name == "torch":
        return True
    if name == "sdpa":
        return (q.device.type == "cpu" and _CPU_FWD is not None
                and q.dtype in (torch.float32, torch.float64, torch.bfloat16))
    flash_ok = (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
                and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)
    if name == "torch_flash":
        return flash_ok and _TORCH_FLASH_FWD is not None and _sm80(q.device)
    if name == "flash":
        return flash_ok and FLASH_ATTN_AVAILABLE
    return False
