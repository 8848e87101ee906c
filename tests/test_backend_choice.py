"""Which attention backend runs where (a pure function, checked here for CUDA on the CPU), the
efficient (memory-efficient, fp32-capable) CUDA backend's plumbing against a CPU stand-in that
keeps the real op's contract, and determinism switches."""

import inspect
import itertools

import pytest
import torch

from megatron_dcp.runtime import backends, kernels
from megatron_dcp.runtime.backends import BackendError, Capabilities, choose_backend
from megatron_dcp.runtime.layout import TokenMeta
from megatron_dcp.runtime.segments import decompose
from test_attention_kernels import _random_metas, _run_block

FULL = Capabilities(flash_attn=True, torch_flash=True, efficient=True)
ALL_CAPS = [Capabilities(*bits) for bits in itertools.product((False, True), repeat=4)]


# ------------------------------------------------------------------ choice
@pytest.mark.parametrize("dtype, caps, want", [
    (torch.float32, FULL, "efficient"),  # fp32 on CUDA: a fused kernel, not the exact loop
    (torch.bfloat16, FULL, "flash"),
    (torch.bfloat16, Capabilities(torch_flash=True, efficient=True), "torch_flash"),
    (torch.float16, Capabilities(efficient=True), "efficient"),  # pre-sm80 GPU
    (torch.float64, FULL, "torch"),  # no fused kernel takes float64
])
def test_cuda_choice(dtype, caps, want):
    assert choose_backend("cuda", dtype, 64, caps) == want


def test_cpu_choice():
    cpu = Capabilities(cpu_fused=True)
    assert choose_backend("cpu", torch.float32, 64, cpu) == "sdpa"
    assert choose_backend("cpu", torch.float16, 64, cpu) == "torch"
    assert choose_backend("cpu", torch.float32, 64, cpu, start="torch") == "torch"
    assert choose_backend("cpu", torch.float32, 64, Capabilities()) == "torch"
    assert choose_backend("cpu", torch.float32, 64, FULL) == "torch"  # CUDA ops skip the CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [6, 64, 128, 320])
def test_cuda_never_takes_the_exact_loop(dtype, head_dim):
    """Whatever is installed, a CUDA dtype that a fused kernel could take never lands on the
    exact kernel: it gets a fused kernel or a clear error naming what is missing."""
    for caps, start in itertools.product(ALL_CAPS, kernels.BACKENDS):
        try:
            name = choose_backend("cuda", dtype, head_dim, caps, start)
        except BackendError as err:
            assert str(dtype) in str(err) and "bfloat16" in str(err)
            continue
        assert name not in ("torch", "sdpa"), (caps, start, name)


def test_exact_kernel_blocks_are_sized_for_the_device():
    """The exact kernel on the CPU cuts a 4k causal sequence into cache-sized blocks; on an
    accelerator (float64 only) into a handful of large ones."""
    meta = TokenMeta.contiguous(4096)
    (call,) = decompose(meta, meta, True).calls
    on_cpu = sum(1 for _ in backends._exact_chunks(call, torch.device("cpu"), 8))
    on_device = sum(1 for _ in backends._exact_chunks(call, torch.device("meta"), 8))
    assert on_cpu >= 128 and on_device <= 2
    assert backends.score_block("cuda") > backends.score_block("cpu")


# ------------------------------------------------------------------ efficient op stand-in
def _schema_signature(op) -> inspect.Signature:
    """A Python signature of the real op's schema (torch 2.13), to bind our calls against."""
    params = []
    for arg in op.default._schema.arguments:
        kind = (inspect.Parameter.KEYWORD_ONLY if arg.kwarg_only
                else inspect.Parameter.POSITIONAL_OR_KEYWORD)
        default = inspect.Parameter.empty if not arg.has_default_value() else arg.default_value
        params.append(inspect.Parameter(arg.name, kind, default=default))
    return inspect.Signature(params)


def _masks(cu_q, cu_k, causal):
    for i in range(cu_q.numel() - 1):
        a, b, c, d = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        mask = torch.ones(b - a, d - c, dtype=torch.bool)
        if causal:  # mask type 1: causal from the top left (query i sees keys 0..i)
            mask = mask.tril()
        yield i, a, b, c, d, mask


class FakeEfficient:
    """``aten._efficient_attention_forward/backward`` on the CPU, from their contract: batch 1
    with cumulative lengths, as many K/V heads as query heads (no GQA), LSE padded to
    ``[segments, H, ceil32(max_q)]``; arguments bound against the real schema."""

    def __init__(self):
        self.fwd_sig = _schema_signature(torch.ops.aten._efficient_attention_forward)
        self.bwd_sig = _schema_signature(torch.ops.aten._efficient_attention_backward)
        self.backward_kwargs = []

    def forward(self, *args, **kwargs):
        a = self.fwd_sig.bind(*args, **kwargs).arguments
        q, k, v = a["query"], a["key"], a["value"]
        assert q.shape[0] == 1 and q.shape[2] == k.shape[2] == v.shape[2]
        assert a["bias"] is None and a["dropout_p"] == 0.0 and a["compute_log_sumexp"]
        assert a["custom_mask_type"] in (0, 1)
        cu_q, cu_k = a["cu_seqlens_q"], a["cu_seqlens_k"]
        assert cu_q.dtype == cu_k.dtype == torch.int32
        width = -(-a["max_seqlen_q"] // 32) * 32
        out = torch.zeros_like(q)
        lse = torch.full((cu_q.numel() - 1, q.shape[2], width), float("nan"))  # padding: junk
        for i, s, e, ks, ke, mask in _masks(cu_q, cu_k, a["custom_mask_type"] == 1):
            assert e - s <= a["max_seqlen_q"] and ke - ks <= a["max_seqlen_k"]
            sc = torch.einsum("nhd,mhd->hnm", q[0, s:e], k[0, ks:ke]) * a["scale"]
            sc = sc.masked_fill(~mask, float("-inf"))
            lse[i, :, :e - s] = torch.logsumexp(sc, -1)
            out[0, s:e] = torch.einsum("hnm,mhd->nhd", torch.softmax(sc, -1), v[0, ks:ke])
        return out, lse, torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long), \
            a["max_seqlen_q"], a["max_seqlen_k"]

    def backward(self, *args, **kwargs):
        a = self.bwd_sig.bind(*args, **kwargs).arguments
        self.backward_kwargs.append({key: a[key] for key in ("num_splits_key", "scale")})
        q, k, v, do, o, lse = (a[n] for n in ("query", "key", "value", "grad_out_", "out",
                                              "logsumexp"))
        assert q.shape[2] == k.shape[2] and lse.dtype == torch.float32
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (do * o).sum(-1)[0]  # [N, H], from the final out as the kernel computes it
        for i, s, e, ks, ke, mask in _masks(a["cu_seqlens_q"], a["cu_seqlens_k"],
                                            a["custom_mask_type"] == 1):
            sc = torch.einsum("nhd,mhd->hnm", q[0, s:e], k[0, ks:ke]) * a["scale"]
            p = torch.exp(sc - lse[i, :, :e - s, None]).masked_fill(~mask, 0.0)
            dp = torch.einsum("nhd,mhd->hnm", do[0, s:e], v[0, ks:ke])
            ds = p * (dp - delta[s:e].t()[..., None])
            dq[0, s:e] = torch.einsum("hnm,mhd->nhd", ds, k[0, ks:ke]) * a["scale"]
            dk[0, ks:ke] += torch.einsum("hnm,nhd->mhd", ds, q[0, s:e]) * a["scale"]
            dv[0, ks:ke] += torch.einsum("hnm,nhd->mhd", p, do[0, s:e])
        return dq, dk, dv, torch.empty(0)


@pytest.fixture
def fake_efficient(monkeypatch):
    fake = FakeEfficient()
    monkeypatch.setattr(backends, "_EFF_FWD", fake.forward)
    monkeypatch.setattr(backends, "_EFF_BWD", fake.backward)
    monkeypatch.setattr(backends, "supports", lambda name, q: name in ("efficient", "torch"))
    return fake


@pytest.mark.parametrize("causal", [True, False])
def test_efficient_plumbing_matches_the_exact_kernel(fake_efficient, causal):
    """Gathers, scatters, padded LSE, GQA head repeat and gradient sum, both calls of a block:
    values, LSE and gradients equal the exact kernel's."""
    for seed in range(3):
        qm, km = _random_metas(seed)
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(len(qm), 4, 8, generator=gen)
        k, v = (torch.randn(len(km), 2, 8, generator=gen) for _ in range(2))
        want = _run_block("torch", q, k, v, qm, km, causal, 0.4)
        got = _run_block("efficient", q, k, v, qm, km, causal, 0.4)
        for a, b in zip((want[0], *want[3]), (got[0], *got[3])):
            assert torch.allclose(a, b, atol=1e-5, rtol=0)
        valid = ~torch.isinf(want[1])
        assert torch.equal(valid, ~torch.isinf(got[1]))
        assert torch.allclose(want[1][valid], got[1][valid], atol=1e-5)


def test_efficient_local_attention_autograd(fake_efficient):
    """One call over all rows in order (no gather) through autograd, float32."""
    meta = TokenMeta.contiguous(40)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(40, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(40, 1, 8, generator=gen, requires_grad=True) for _ in range(2))
    g = torch.randn(40, 4, 8, generator=gen)
    results = {}
    for name in ("torch", "efficient"):
        with kernels.forced_backend(name):
            out = kernels.local_attention(q, k, v, meta, causal=True)
        results[name] = (out, *torch.autograd.grad(out, (q, k, v), g))
    for a, b in zip(*results.values()):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_efficient_forward_call_fits_the_real_op():
    """Our forward call runs through torch's own registration of the op on the meta device:
    argument order and the padded LSE shape are the real ones."""
    qm, km = _random_metas(1)
    dev = torch.device("meta")
    block = decompose(qm, km, True)
    q = torch.empty(len(qm), 4, 8, device=dev)
    k = v = torch.empty(len(km), 2, 8, device=dev)
    for call in block.calls:
        out, lse = backends.efficient_forward(call, q, k, v, 0.3)
        assert out.shape == q.shape and lse.shape == q.shape[:2]
        assert lse.dtype == torch.float32


# ------------------------------------------------------------------ determinism
def test_determinism_reaches_the_kernels(fake_efficient, monkeypatch):
    """torch.use_deterministic_algorithms (or the explicit flag) reaches the efficient op's
    backward (no key splits) and the accumulation of repeated key rows (no index_add_)."""
    used = []
    real = torch.Tensor.index_put_
    monkeypatch.setattr(torch.Tensor, "index_put_",
                        lambda self, *a, **kw: used.append(1) or real(self, *a, **kw))
    qm, km = _random_metas(0)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(qm), 2, 8, generator=gen)
    k, v = (torch.randn(len(km), 2, 8, generator=gen) for _ in range(2))
    before = torch.are_deterministic_algorithms_enabled()
    try:
        _run_block("efficient", q, k, v, qm, km, True, 0.4)
        assert fake_efficient.backward_kwargs[-1]["num_splits_key"] is None and not used
        torch.use_deterministic_algorithms(True)
        assert backends.deterministic() and not backends.deterministic(False)
        _run_block("efficient", q, k, v, qm, km, True, 0.4)
        assert fake_efficient.backward_kwargs[-1]["num_splits_key"] == 1 and used
    finally:
        torch.use_deterministic_algorithms(before)
    assert backends.deterministic(True)


def test_flash_attn_is_told_to_be_deterministic():
    def fake_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p,
                      softmax_scale, causal, window_size_left, window_size_right, softcap,
                      alibi_slopes, deterministic, rng_state=None):
        pass

    assert backends._flash_attn_kwargs(fake_backward, True)["deterministic"] is False
    assert backends._flash_attn_kwargs(fake_backward, True, True)["deterministic"] is True
