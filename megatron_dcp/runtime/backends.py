"""Kernels that run one varlen call (`megatron_dcp.runtime.segments.Call`) of an attention block.

Each backend has a forward, returning this call's ``(out [Tq, Hq, D], lse [Tq, Hq])`` (rows the
call does not cover: 0 and -inf), and a backward that adds this call's ``dq, dk, dv`` into a
`Grads` from the *final* merged ``out`` and ``lse`` of the queries (``P = exp(S * scale - lse)``,
``D = rowsum(dout * out)``, ``dS = P * (dP - D)``), which is what the flash kernels' backward
computes. GQA is native everywhere (query head ``h`` uses key head ``h // (Hq // Hkv)``).

* ``flash``: flash-attn 2's ``_flash_attn_varlen_forward/backward`` (CUDA, fp16/bf16).
* ``torch_flash``: torch's own ``aten._flash_attention_forward/backward`` with cumulative
  lengths (CUDA sm80+, fp16/bf16). Both flash LSEs are ``[Hq, Tq]`` fp32.
* ``efficient``: torch's memory-efficient op ``aten._efficient_attention_forward/backward``
  (the fused kernel of SDPA's memory-efficient path; CUDA, float32/float16/bfloat16, any sm50+
  GPU): varlen through cumulative lengths, LSE ``[segments, Hq, ceil32(max_q)]`` fp32. It has no
  GQA, so K/V heads are repeated for it (and their gradients summed back). float32 on CUDA
  runs here.
* ``sdpa``: torch's fused CPU flash-attention op, one call per group of equal-shape segments.
* ``torch``: the exact chunked torch kernel: the reference on the CPU (float16 there too), and
  float64 on an accelerator (no fused kernel takes it), with blocks sized for the device
  (`score_block`). Other dtypes on CUDA never reach it: no fused kernel is an error
  (`choose_backend`), not hundreds of thousands of small launches per layer.

Which backend runs is a pure function of (device type, dtype, head size, what is installed):
`backend_supports` and `choose_backend` over `Capabilities`, so CPU tests check the CUDA choice.

Determinism (`deterministic`): when asked for (an argument, else
``torch.are_deterministic_algorithms_enabled()``), flash-attn and the efficient op run their
deterministic backward and gradients of repeated key rows are summed with a sorted
``index_put_`` instead of ``index_add_``'s atomics. torch's own flash op follows torch's setting
only.

Index tensors come from the host decomposition, uploaded once: nothing here reads a device value
back to the host.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from megatron_dcp.runtime.segments import Call

ORDER = ("flash", "torch_flash", "efficient", "sdpa", "torch")
"""Backends in the order a call falls back through (`choose_backend`)."""

SCORE_BLOCK = 1 << 20
"""Score elements per dense block of the exact kernel on the CPU (query rows x keys x heads):
bounds its memory and keeps every elementwise pass over the scores inside the CPU caches."""
DEVICE_SCORE_BLOCK = 1 << 26
"""The same on an accelerator (256 MB of fp64 scores per temporary): few, large launches."""

_CPU_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_TORCH_FLASH_FWD = getattr(torch.ops.aten, "_flash_attention_forward", None)
_TORCH_FLASH_BWD = getattr(torch.ops.aten, "_flash_attention_backward", None)
_EFF_FWD = getattr(torch.ops.aten, "_efficient_attention_forward", None)
_EFF_BWD = getattr(torch.ops.aten, "_efficient_attention_backward", None)
LSE_ALIGN = 32
"""The efficient op pads each segment's LSE row to a multiple of this many queries."""

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

    def __init__(self, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype,
                 deterministic: bool = False) -> None:
        self.q_shape, self.k_shape, self.dtype, self.device = q.shape, k.shape, dtype, q.device
        self.deterministic = deterministic
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
            elif self.deterministic:  # key rows repeat across segments: no atomics
                buf.index_put_((rows,), g.reshape(-1, *buf.shape[1:]).to(self.dtype),
                               accumulate=True)
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


def deterministic(flag: Optional[bool] = None) -> bool:
    """Whether backward must be deterministic: ``flag`` when given (a framework's own switch,
    such as Megatron's ``deterministic_mode``), else torch's ``use_deterministic_algorithms``
    (not in its warn-only mode, which asks for a warning, not for slower kernels)."""
    if flag is not None:
        return bool(flag)
    return (torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled())


# ---------------------------------------------------------------------------- exact kernel
def score_block(device_type: str) -> int:
    """Score elements per block of the exact kernel on a device of this type."""
    return SCORE_BLOCK if device_type == "cpu" else DEVICE_SCORE_BLOCK


def _exact_chunks(call: Call, device, heads: int):
    """``(query rows [b, n], key rows [b, m], first query index)`` blocks of at most
    `score_block` scores; causal blocks drop the keys after their last query."""
    budget = score_block(torch.device(device).type)
    for q2, k2 in call.shapes(device):
        b, n = q2.shape
        m = k2.shape[1]
        per = max(1, budget // (heads * m))  # query rows per block
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
def _flash_attn_kwargs(fn, backward: bool, deterministic: bool = False) -> dict:
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
        kw["deterministic"] = deterministic
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
    """Backward of one call with a flash varlen kernel, from the final ``out`` and ``lse``
    (torch's flash op reads torch's deterministic setting itself; flash-attn is told ours)."""
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
                call.max_k, 0.0, scale, call.causal,
                **_flash_attn_kwargs(_FA_BWD, True, grads.deterministic))
    grads.add(rows.q, dq, rows.k, dk, dv)


# ---------------------------------------------------------------------------- efficient (CUDA)
def _lse_width(call: Call) -> int:
    return -(-call.max_q // LSE_ALIGN) * LSE_ALIGN


@lru_cache(maxsize=None)
def _no_dropout_state():
    """The op's philox seed/offset when dropout is off: host scalars it never reads."""
    return torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


def _efficient_inputs(call: Call, q, k, v):
    """Gathered rows as ``[1, N, H, D]`` with K/V heads repeated to the query heads."""
    rows = call.rows(q.device)
    rep = q.shape[1] // k.shape[1]
    qg = _take(q, rows.q)
    kg, vg = (_take(x, rows.k) for x in (k, v))
    if rep > 1:
        kg, vg = (x.repeat_interleave(rep, dim=1) for x in (kg, vg))
    return rows, rep, qg.unsqueeze(0), kg.unsqueeze(0), vg.unsqueeze(0)


def efficient_forward(call: Call, q, k, v, scale: float):
    """Forward of one call with the efficient op; ``out`` in the input dtype, LSE fp32."""
    rows, _, qg, kg, vg = _efficient_inputs(call, q, k, v)
    o, lse = _EFF_FWD(qg, kg, vg, None, rows.cu_q, rows.cu_k, call.max_q, call.max_k, 0.0,
                      int(call.causal), True, scale=scale)[:2]
    want = (call.num_segments, q.shape[1], _lse_width(call))
    if tuple(lse.shape) != want:
        raise RuntimeError(f"efficient attention: LSE of shape {tuple(lse.shape)}, expected "
                           f"[segments, Hq, ceil32(max_q)] = {want}")
    lse = lse.transpose(1, 2).reshape(-1, q.shape[1])
    lse = lse.index_select(0, call.padded_rows(q.device, _lse_width(call)))
    return _scatter(rows.q, o[0], lse, q)


def efficient_backward(call: Call, dout, q, k, v, out, lse, scale: float, grads: Grads) -> None:
    """Backward of one call with the efficient op, from the final ``out`` and ``lse``."""
    rows, rep, qg, kg, vg = _efficient_inputs(call, q, k, v)
    dog = _take(dout, rows.q).to(q.dtype).unsqueeze(0)
    og = _take(out, rows.q).to(q.dtype).unsqueeze(0)
    lse_g = (lse if rows.q is None else lse.index_select(0, rows.q)).float()
    width, heads = _lse_width(call), q.shape[1]
    padded = lse_g.new_zeros((call.num_segments * width, heads))
    padded.index_copy_(0, call.padded_rows(q.device, width), lse_g)
    padded = padded.view(call.num_segments, width, heads).transpose(1, 2).contiguous()
    seed, offset = _no_dropout_state()
    dq, dk, dv = _EFF_BWD(dog, qg, kg, vg, None, og, rows.cu_q, rows.cu_k, call.max_q,
                          call.max_k, padded, 0.0, seed, offset, int(call.causal), False,
                          scale=scale, num_splits_key=1 if grads.deterministic else None)[:3]
    dk, dv = dk[0], dv[0]
    if rep > 1:  # the repeated heads' gradients summed back onto their K/V head
        dk, dv = (x.float().unflatten(1, (-1, rep)).sum(2) for x in (dk, dv))
    grads.add(rows.q, dq[0], rows.k, dk, dv)


# ---------------------------------------------------------------------------- choice
class BackendError(RuntimeError):
    """No attention backend can run these inputs (names device, dtype and what is missing)."""


@dataclass(frozen=True)
class Capabilities:
    """What one device offers the backends (`capabilities`); tests build their own."""

    flash_attn: bool = False
    """flash-attn >= 2.6 is installed."""
    torch_flash: bool = False
    """torch's flash varlen ops run on this device (a CUDA build, sm80 or newer)."""
    efficient: bool = False
    """torch's memory-efficient attention op has a kernel for this device."""
    cpu_fused: bool = False
    """torch's fused CPU flash-attention op exists."""


def _has_kernel(op: str, key: str) -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, key))
    except Exception:  # noqa: BLE001 - an older torch without the query: assume present
        return True


@lru_cache(maxsize=None)
def capabilities(device: torch.device) -> Capabilities:
    """The `Capabilities` of ``device`` (a CUDA device's compute capability is read once)."""
    if device.type == "cuda":
        sm80 = torch.cuda.get_device_capability(device) >= (8, 0)
        return Capabilities(
            flash_attn=FLASH_ATTN_AVAILABLE,
            torch_flash=(sm80 and _TORCH_FLASH_FWD is not None
                         and _has_kernel("aten::_flash_attention_forward", "CUDA")),
            efficient=(_EFF_FWD is not None
                       and _has_kernel("aten::_efficient_attention_forward", "CUDA")))
    return Capabilities(cpu_fused=device.type == "cpu" and _CPU_FWD is not None)


_HALF = (torch.float16, torch.bfloat16)


def backend_supports(name: str, device_type: str, dtype: torch.dtype, head_dim: int,
                     caps: Capabilities) -> bool:
    """Whether backend ``name`` runs attention of this device type, dtype and head size."""
    if name == "torch":  # on an accelerator only where no fused kernel takes the dtype
        return device_type == "cpu" or dtype == torch.float64
    if name == "sdpa":
        return (device_type == "cpu" and caps.cpu_fused
                and dtype in (torch.float32, torch.float64, torch.bfloat16))
    if name == "efficient":
        return (device_type == "cuda" and caps.efficient
                and dtype in (torch.float32, *_HALF) and head_dim % (16 // (
                    4 if dtype == torch.float32 else 2)) == 0)
    flash_ok = (device_type == "cuda" and dtype in _HALF and head_dim % 8 == 0
                and head_dim <= 256)
    if name == "torch_flash":
        return flash_ok and caps.torch_flash
    if name == "flash":
        return flash_ok and caps.flash_attn
    return False


def choose_backend(device_type: str, dtype: torch.dtype, head_dim: int, caps: Capabilities,
                   start: Optional[str] = None) -> str:
    """``start`` (default: the first of `ORDER`) or the first backend after it in `ORDER` that
    supports the inputs; `BackendError` when none does."""
    names = ORDER[ORDER.index(start):] if start is not None else ORDER
    for name in names:
        if backend_supports(name, device_type, dtype, head_dim, caps):
            return name
    missing = []
    if device_type == "cuda":
        if not caps.efficient:
            missing.append("this torch build has no memory-efficient attention kernel for CUDA")
        missing.append("the efficient kernel needs a head size that is a multiple of 4 "
                       "(float32) or 8 (float16/bfloat16), the flash kernels half precision")
    raise BackendError(
        f"no attention backend for {dtype} with head size {head_dim} on {device_type}"
        f" (tried {', '.join(names)}){': ' + '; '.join(missing) if missing else ''}. Train in "
        "bfloat16, use a head size that is a multiple of 8, or a torch build with "
        "memory-efficient attention; the exact torch kernel is not run on an accelerator "
        "for this dtype (too slow).")


def supports(name: str, q: torch.Tensor) -> bool:
    """Whether backend ``name`` can run attention on ``q``'s device, dtype and head size."""
    return backend_supports(name, q.device.type, q.dtype, q.shape[-1], capabilities(q.device))
