"""Attention over packed tokens with per-token positions, sequence ids and attention groups.

A query token sees key token ``k`` iff both are valid (not padding), they belong to the same
sequence, ``pos_k <= pos_q`` when causal, and their attention-group ids match when given. A query
that sees no key gets output 0 and ``lse = -inf``. Shapes: ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``
with ``Hq % Hkv == 0`` (GQA); ``lse [Tq, Hq]``.

* **Blocks** (`block_forward`, `block_backward`): the queries of one token set against the keys of
  another, decomposed once on the host into varlen calls (`megatron_dcp.runtime.segments`) and run
  by a backend (`megatron_dcp.runtime.backends`). ``block_backward`` takes the *final* merged
  ``out``/``lse`` of all blocks; ring attention is built from these and `merge_block`.
* **Local attention** (`local_attention`): a token set against itself, differentiable: one varlen
  call over all packed sequences (and attention groups) for degree 1 and after Ulysses.

Backends (`BACKENDS`, in fallback order): ``flash`` (flash-attn 2, CUDA), ``torch_flash``
(torch's own flash varlen ops, CUDA sm80+), ``efficient`` (torch's memory-efficient op, CUDA:
float32, or half precision on older GPUs), ``sdpa`` (torch's fused CPU op), ``torch`` (exact
kernel: the reference, float16 on the CPU and float64 anywhere). The process picks the first one
available (`selected_backend`); `forced_backend` overrides it; a call that the chosen backend
cannot run (device, dtype, head size) uses the next one in the order
(`megatron_dcp.runtime.backends.choose_backend`), so results never depend on the choice beyond
rounding; on CUDA a dtype no fused kernel takes is an error, never the exact kernel's loop. Half
inputs are merged in float32 (`compute_dtype`). ``deterministic`` (default: torch's
``use_deterministic_algorithms``) selects deterministic backward kernels and accumulation.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

import torch

from megatron_dcp.runtime import backends as _bk
from megatron_dcp.runtime.layout import TokenMeta
from megatron_dcp.runtime.segments import Block, decompose, upload

BACKENDS = _bk.ORDER
_SELECTED: Optional[str] = None
_FORCED: ContextVar[Optional[str]] = ContextVar("megatron_dcp_attention_backend", default=None)
_CACHED_GROUPS = 16


def selected_backend() -> str:
    """The attention backend of this process (decided once from what is available), or the one
    forced in this thread."""
    global _SELECTED
    forced = _FORCED.get()
    if forced is not None:
        return forced
    if _SELECTED is None:
        # The first backend any dtype can use here; calls fall forward from it (resolve_backend).
        cuda = torch.cuda.is_available()
        caps = _bk.capabilities(torch.device("cuda") if cuda else torch.device("cpu"))
        _SELECTED = next((b for b, ok in (("flash", caps.flash_attn),
                                          ("torch_flash", caps.torch_flash),
                                          ("efficient", caps.efficient),
                                          ("sdpa", caps.cpu_fused)) if ok), "torch")
    return _SELECTED


@contextmanager
def forced_backend(name: str) -> Iterator[None]:
    """Use backend ``name`` inside the block (tests and benchmarks compare backends)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {BACKENDS}")
    if name == "flash" and not _bk.FLASH_ATTN_AVAILABLE:
        raise ValueError("attention backend 'flash' requested but flash_attn is not installed")
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def resolve_backend(q: torch.Tensor, name: Optional[str] = None) -> str:
    """The backend that runs attention on ``q``: ``name`` (default `selected_backend`) or the
    first one after it in `BACKENDS` that supports ``q``'s device, dtype and head size
    (`megatron_dcp.runtime.backends.BackendError` when none does)."""
    start = name or selected_backend()
    for b in BACKENDS[BACKENDS.index(start):]:
        if _bk.supports(b, q):
            return b
    return _bk.choose_backend(q.device.type, q.dtype, q.shape[-1], _bk.capabilities(q.device),
                              start)  # raises, naming what is missing


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype blocks are merged in (float64 stays, everything else float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_groups(group_of_position: Optional[Callable], meta: TokenMeta
                     ) -> Optional[torch.Tensor]:
    """Attention-group id of every token of ``meta``, on ``meta``'s device (``None``: no groups).

    Computed once per (token set, function) from the host positions and uploaded, so the kernels
    find the host copy (`host_groups`) without reading the device.
    """
    if group_of_position is None:
        return None
    host = meta.host()
    known = host.cache.setdefault("groups", {})
    try:
        entry = known.get(group_of_position)
    except TypeError:  # an unhashable callable: computed on every call
        entry = None
    if entry is None:
        groups = group_of_position(host.positions)
        if not isinstance(groups, torch.Tensor) or groups.shape != host.positions.shape:
            raise ValueError("group_of_position must map a LongTensor of positions to a tensor "
                             "of group ids of the same shape")
        entry = {"cpu": groups.cpu()}
        try:
            _remember(known, group_of_position, entry)
        except TypeError:
            pass
    device = meta.positions.device
    if str(device) not in entry:
        entry[str(device)] = upload(entry["cpu"], device)
        _remember(host.cache.setdefault("groups_host", {}), id(entry[str(device)]),
                  (entry[str(device)], entry["cpu"]))
    return entry[str(device)]


def _remember(cache: dict, key, value) -> None:
    """``cache[key] = value``, keeping the newest `_CACHED_GROUPS` entries (a model that makes a
    new group function per call must not grow the cache of a long-lived token set)."""
    cache[key] = value
    if len(cache) > _CACHED_GROUPS:
        cache.pop(next(iter(cache)))


def host_groups(groups: Optional[torch.Tensor], meta: TokenMeta) -> Optional[torch.Tensor]:
    """The host copy of ``groups`` (ids of ``meta``'s tokens): found when `attention_groups` made
    them, otherwise copied back once (a device sync) and remembered."""
    if groups is None or groups.device.type == "cpu":
        return groups
    known = meta.host().cache.setdefault("groups_host", {})
    entry = known.get(id(groups))
    if entry is None or entry[0] is not groups:
        entry = (groups, groups.cpu())
        _remember(known, id(groups), entry)
    return entry[1]


def _block(q_meta, k_meta, causal, q_groups, k_groups) -> Block:
    return decompose(q_meta, k_meta, causal, host_groups(q_groups, q_meta),
                     host_groups(k_groups, k_meta))


def run_forward(block: Block, q, k, v, scale: float, backend: str):
    """``(out, lse)`` of a decomposed block (``out`` stays in the input dtype after one flash
    call over all rows)."""
    cdt = compute_dtype(q.dtype)
    out = lse = None
    for call in block.calls:
        if backend in ("flash", "torch_flash"):
            o, l = _bk.flash_forward(backend, call, q, k, v, scale)
        elif backend == "efficient":
            o, l = _bk.efficient_forward(call, q, k, v, scale)
        elif backend == "sdpa":
            o, l = _bk.cpu_forward(call, q, k, v, scale, cdt)
        else:
            o, l = _bk.exact_forward(call, q, k, v, scale, cdt)
        out, lse = merge_block(out, lse, o, l)
    if out is None:
        return (q.new_zeros(q.shape, dtype=cdt),
                q.new_full(q.shape[:2], float("-inf"), dtype=cdt))
    return out, lse


def run_backward(block: Block, dout, q, k, v, out, lse, scale: float, backend: str,
                 deterministic: bool = False):
    """``dq, dk, dv`` of a decomposed block from the final ``out``/``lse`` (dtype: see `Grads`)."""
    cdt = compute_dtype(q.dtype)
    grads = _bk.Grads(q, k, cdt, deterministic)
    delta = None
    for call in block.calls:
        if backend in ("flash", "torch_flash"):
            _bk.flash_backward(backend, call, dout, q, k, v, out, lse, scale, grads)
        elif backend == "efficient":
            _bk.efficient_backward(call, dout, q, k, v, out, lse, scale, grads)
        elif backend == "sdpa":
            _bk.cpu_backward(call, dout, q, k, v, out, lse, scale, cdt, grads)
        else:
            if delta is None:
                delta = (dout.to(cdt) * out.to(cdt)).sum(-1)
            _bk.exact_backward(call, dout, q, k, v, out, lse, scale, cdt, grads, delta)
    return grads.result()


def block_forward(q, k, v, q_meta: TokenMeta, k_meta: TokenMeta, *, causal: bool, scale: float,
                  q_groups=None, k_groups=None, backend: Optional[str] = None):
    """Attention of ``q`` against one K/V block: ``(out, lse)`` in the compute dtype.

    ``backend``: a name from `BACKENDS` (default: `selected_backend`, falling back as needed).
    """
    block = _block(q_meta, k_meta, causal, q_groups, k_groups)
    out, lse = run_forward(block, q, k, v, scale, resolve_backend(q, backend))
    cdt = compute_dtype(q.dtype)
    return out.to(cdt), lse.to(cdt)


def block_backward(dout, q, k, v, out, lse, q_meta: TokenMeta, k_meta: TokenMeta, *,
                   causal: bool, scale: float, q_groups=None, k_groups=None,
                   backend: Optional[str] = None, deterministic: Optional[bool] = None):
    """``dq, dk, dv`` (compute dtype) of one K/V block from the final merged ``out``/``lse``
    (``deterministic``: see `megatron_dcp.runtime.backends.deterministic`)."""
    block = _block(q_meta, k_meta, causal, q_groups, k_groups)
    cdt = compute_dtype(q.dtype)
    grads = run_backward(block, dout, q, k, v, out, lse, scale, resolve_backend(q, backend),
                         _bk.deterministic(deterministic))
    return tuple(g.to(cdt) for g in grads)


def merge_block(out, lse, blk_out, blk_lse):
    """Log-sum-exp merge of a partial result with one more block's ``(out, lse)``."""
    if out is None:
        return blk_out, blk_lse
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    merged = out * torch.exp(lse - safe)[..., None] + blk_out * torch.exp(blk_lse - safe)[..., None]
    return merged, new


class LocalAttention(torch.autograd.Function):
    """Attention of a token set with itself; the backward recomputes from ``lse`` (saves memory)."""

    @staticmethod
    def forward(ctx, q, k, v, meta: TokenMeta, causal: bool, scale: float, groups, backend: str,
                deterministic: bool):
        block = _block(meta, meta, causal, groups, groups)
        out, lse = run_forward(block, q, k, v, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        # The backend travels with the graph: CUDA runs backward on a thread without our context.
        ctx.block, ctx.scale, ctx.backend, ctx.deterministic = block, scale, backend, deterministic
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = run_backward(ctx.block, dout, q, k, v, out, lse, ctx.scale, ctx.backend,
                                  ctx.deterministic)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None,
                None)


def local_attention(q, k, v, meta: TokenMeta, *, causal: bool = True,
                    softmax_scale: Optional[float] = None, groups: Optional[torch.Tensor] = None,
                    deterministic: Optional[bool] = None) -> torch.Tensor:
    """Attention of the tokens of ``meta`` among themselves (differentiable); ``out [T, Hq, D]``.

    ``groups`` (attention-group id per token, see `attention_groups`) further restricts attention
    to equal ids: each (sequence, group) is one varlen segment, no mask is built.
    ``deterministic``: a deterministic backward (default: torch's setting, read now).
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return LocalAttention.apply(q, k, v, meta, causal, scale, groups, resolve_backend(q),
                                _bk.deterministic(deterministic))
