"""Single-process tests of the block kernels: decomposition, backends, merging, block backward."""

import math
import threading

import pytest
import torch

from megatron_dcp.runtime import backends, kernels
from megatron_dcp.runtime.layout import ShardLayout, TokenMeta
from megatron_dcp.runtime.segments import decompose
from test_attention import reference

CPU_BACKENDS = ["torch", "sdpa"]


def _concat(metas):
    return TokenMeta(*(torch.cat([getattr(m, f) for m in metas])
                       for f in ("positions", "seq_ids", "valid")))


def _masked_reference(q, k, v, qm, km, causal, scale, qg=None, kg=None):
    """Dense float64 attention of every query row against every key row, with all masks."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    mask = (qm.seq_ids[:, None] == km.seq_ids[None, :]) & qm.valid[:, None] & km.valid[None, :]
    if causal:
        mask &= km.positions[None, :] <= qm.positions[:, None]
    if qg is not None:
        mask &= qg[:, None] == kg[None, :]
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hnm,mhd->nhd", p, v)


def _run_block(backend, q, k, v, qm, km, causal, scale, qg=None, kg=None):
    """One block forward + backward (with a random upstream gradient) through `backend`."""
    with torch.no_grad(), kernels.forced_backend(backend):
        out, lse = kernels.block_forward(q, k, v, qm, km, causal=causal, scale=scale,
                                         q_groups=qg, k_groups=kg)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
        grads = kernels.block_backward(dout, q, k, v, out, lse, qm, km, causal=causal,
                                       scale=scale, q_groups=qg, k_groups=kg)
    return out, lse, dout, grads


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ring", [2, 3])
def test_blocks_merge_to_full_attention(monkeypatch, backend, causal, ring):
    """Split keys into zigzag ring portions; merged forward and summed block grads are exact."""
    monkeypatch.setattr(backends, "SCORE_BLOCK", 1)  # exact kernel: blocks of a few rows
    lengths = (11, 4, 17)
    metas = [ShardLayout.build(lengths, 1, ring, j).meta() for j in range(ring)]
    qmeta = _concat(metas)
    t, gen = len(qmeta), torch.Generator().manual_seed(0)
    q = torch.randn(t, 6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(t, 2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(t, 6, 5, generator=gen, dtype=torch.float64)
    keep = qmeta.valid
    want = reference(q[keep], k[keep], v[keep], qmeta.seq_ids[keep], qmeta.positions[keep], causal)
    grads = torch.autograd.grad(want, (q, k, v), dout[keep])

    scale, bounds = 1 / math.sqrt(5), torch.tensor([0, *[len(m) for m in metas]]).cumsum(0)
    blocks = [slice(int(bounds[j]), int(bounds[j + 1])) for j in range(ring)]
    out = lse = None
    with torch.no_grad(), kernels.forced_backend(backend):
        for j, sl in enumerate(blocks):
            o, l = kernels.block_forward(q, k[sl], v[sl], qmeta, metas[j], causal=causal,
                                         scale=scale)
            out, lse = kernels.merge_block(out, lse, o, l)
        assert torch.allclose(out[keep], want, atol=1e-12, rtol=0)
        assert (out[~keep] == 0).all() and torch.isinf(lse[~keep]).all()
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for j, sl in enumerate(blocks):
            a, b, c = kernels.block_backward(dout, q, k[sl], v[sl], out, lse, qmeta, metas[j],
                                             causal=causal, scale=scale)
            dq += a
            dk[sl] += b
            dv[sl] += c
    for got, ref in zip((dq, dk, dv), grads):
        assert torch.allclose(got, ref, atol=1e-12, rtol=0)


def _random_metas(seed):
    """Query and key token sets of 3 sequences: random subsets of positions, shuffled rows,
    padding, partial overlaps (not a layout the runtime makes: every decomposition case)."""
    gen = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(2):
        pos, seq = [], []
        for s, n in enumerate((9, 14, 6)):
            keep = torch.randperm(n, generator=gen)[:int(torch.randint(1, n + 1, (1,),
                                                                        generator=gen))]
            pos.append(keep)
            seq.append(torch.full_like(keep, s))
        pos, seq = torch.cat(pos), torch.cat(seq)
        valid = torch.rand(pos.shape, generator=gen) > 0.15
        order = torch.randperm(pos.numel(), generator=gen)
        sets.append(TokenMeta(pos[order], seq[order], valid[order]))
    return sets


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_any_token_sets_match_dense_reference(backend, causal, grouped, seed):
    """Arbitrary query/key sets (both calls, merges, empty rows) match a dense masked reference,
    forward and backward (gradients through autograd of the reference)."""
    qm, km = _random_metas(seed)
    qg, kg = (qm.positions % 3, km.positions % 3) if grouped else (None, None)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(qm), 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(len(km), 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out, lse, dout, (dq, dk, dv) = _run_block(backend, q, k, v, qm, km, causal, 0.4, qg, kg)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _masked_reference(*ref_in, qm, km, causal, 0.4, qg, kg)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    for got, want in zip((dq, dk, dv), ref_grads):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_zigzag_steps_are_one_call_each():
    """Ring degree 3 over packed sequences: every step is one varlen call of the expected kind."""
    lengths, ring = (30, 12, 7), 3
    metas = [ShardLayout.build(lengths, 1, ring, j).meta() for j in range(ring)]
    for j in range(ring):
        for src in range(ring):
            block = decompose(metas[j], metas[src], True)
            assert len(block.calls) == 1 if src <= j else len(block.calls) <= 1
            if src == j:  # diagonal: one square causal segment per sequence
                (call,) = block.calls
                assert call.causal and torch.equal(call.q_lens, call.k_lens)
                assert call.num_segments == len(lengths)
            elif src < j:  # all valid queries against the first key half
                (call,) = block.calls
                assert not call.causal and call.q_rows.numel() == int(metas[j].valid.sum())
            elif block.calls:  # the second query half against all keys
                (call,) = block.calls
                assert not call.causal
                assert call.q_rows.numel() < int(metas[j].valid.sum())
    assert decompose(metas[0], metas[1], True) is decompose(metas[0], metas[1], True)  # cached


def test_video_groups_are_segments_not_masks():
    """Temporal groups at degree 1: one causal segment per (sequence, group), no padding rows."""
    meta = ShardLayout.build([40, 12], 1, 1, 0).meta()
    groups = meta.positions % 4
    (call,) = decompose(meta, meta, True, groups, groups).calls
    assert call.num_segments == 8 and call.causal and call.max_q == 10
    assert torch.equal(torch.sort(call.q_rows).values, torch.arange(52))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_local_attention_with_groups_is_exact(backend):
    meta = ShardLayout.build([23, 9], 1, 1, 0).meta()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(32, h, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (4, 1, 1))
    groups = kernels.attention_groups(lambda p: p // 5, meta)
    with kernels.forced_backend(backend):
        out = kernels.local_attention(q, k, v, meta, causal=True, softmax_scale=0.3,
                                      groups=groups)
    want = _masked_reference(q, k, v, meta, meta, True, 0.3, groups, groups)
    assert torch.allclose(out, want, atol=1e-12, rtol=0)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(got, torch.autograd.grad(want, (q, k, v), g)):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_backend_choice_is_reported_forcible_and_falls_back():
    assert kernels.selected_backend() in kernels.BACKENDS
    with kernels.forced_backend("torch"):
        assert kernels.selected_backend() == "torch"
    with kernels.forced_backend("torch_flash"):  # a CUDA backend, given CPU tensors
        assert kernels.resolve_backend(torch.zeros(2, 1, 8)) == "sdpa"
        assert kernels.resolve_backend(torch.zeros(2, 1, 8, dtype=torch.float16)) == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        with kernels.forced_backend("cudnn"):
            pass


def test_bfloat16_block_accumulates_output_and_lse_in_float32():
    """A block of bf16 inputs returns its partial output and log-sum-exp in float32 (the ring's
    merge accumulates there), equal to the block computed from the same values in float32."""
    meta = TokenMeta.contiguous(7)
    q = torch.randn(7, 2, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out, lse = kernels.block_forward(q, q, q, meta, meta, causal=True, scale=0.5)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref_out, ref_lse = kernels.block_forward(*(q.float(),) * 3, meta, meta, causal=True, scale=0.5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)


def test_device_copy_keeps_its_host_metadata():
    """Kernels plan from the host copy: `to` keeps it, without reading the device back."""
    meta = ShardLayout.build([5, 3], 1, 2, 1).meta()
    moved = meta.to(torch.device("meta"))
    assert moved.positions.device.type == "meta" and moved.host() is meta
    assert meta.to("meta") is moved and moved.to("cpu") is meta
    groups = kernels.attention_groups(lambda p: p // 2, moved)
    assert groups.device.type == "meta"
    assert torch.equal(kernels.host_groups(groups, moved), meta.positions // 2)


def test_backward_keeps_the_forward_backend_on_another_thread(monkeypatch):
    """CUDA runs backward on its own thread, where forced_backend is not visible."""
    used = []
    real = backends.exact_backward
    monkeypatch.setattr(backends, "exact_backward",
                        lambda *a, **kw: used.append(1) or real(*a, **kw))
    meta = TokenMeta.contiguous(6)
    q = torch.randn(6, 2, 8, requires_grad=True)
    with kernels.forced_backend("torch"):
        out = kernels.local_attention(q, q, q, meta)
    worker = threading.Thread(target=lambda: out.sum().backward())
    worker.start()
    worker.join()
    assert used and q.grad is not None


# ------------------------------------------------------------------ flash plumbing on the CPU
def _fake_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
    """CPU stand-in for ``aten._flash_attention_forward``: bottom-right causal varlen segments,
    native GQA, LSE ``[Hq, total_q]`` fp32 (so the gather/scatter/LSE plumbing is tested here)."""
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("inf"))
    rep = q.shape[1] // k.shape[1]
    for i in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        s = torch.einsum("nhd,mhd->hnm", q[a:b].float(),
                         k[c:d].float().repeat_interleave(rep, 1)) * scale
        if causal:
            n, m = b - a, d - c
            s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).tril(m - n).logical_not(),
                              float("-inf"))
        lse[:, a:b] = torch.logsumexp(s, -1)
        out[a:b] = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1),
                                v[c:d].float().repeat_interleave(rep, 1)).to(q.dtype)
    return out, lse, None, None, None


def _fake_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal,
                         rng, unused, *, scale):
    """CPU stand-in for ``aten._flash_attention_backward`` from the given (final) out and LSE."""
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
    dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    for i in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qs, do, o = q[a:b].float(), dout[a:b].float(), out[a:b].float()
        ks, vs = (t[c:d].float().repeat_interleave(rep, 1) for t in (k, v))
        s = torch.einsum("nhd,mhd->hnm", qs, ks) * scale
        if causal:
            n, m = b - a, d - c
            s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).tril(m - n).logical_not(),
                              float("-inf"))
        p = torch.exp(s - lse[:, a:b, None])
        ds = p * (torch.einsum("nhd,mhd->hnm", do, vs) - (do * o).sum(-1).t()[..., None])
        dq[a:b] += torch.einsum("hnm,mhd->nhd", ds, ks) * scale
        dk[c:d] += (torch.einsum("hnm,nhd->mhd", ds, qs) * scale).unflatten(1, (-1, rep)).sum(2)
        dv[c:d] += torch.einsum("hnm,nhd->mhd", p, do).unflatten(1, (-1, rep)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_plumbing_with_a_cpu_stand_in(monkeypatch, causal):
    """The flash backends' gathers, scatters, LSE layout and GQA, with a CPU stand-in kernel."""
    monkeypatch.setattr(backends, "_TORCH_FLASH_FWD", _fake_flash_forward)
    monkeypatch.setattr(backends, "_TORCH_FLASH_BWD", _fake_flash_backward)
    monkeypatch.setattr(backends, "supports", lambda name, q: name in ("torch_flash", "torch"))
    monkeypatch.setattr(backends, "_device_state", lambda device: (None, None))
    for seed in range(3):
        qm, km = _random_metas(seed)
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(len(qm), 4, 8, generator=gen)
        k, v = (torch.randn(len(km), 2, 8, generator=gen) for _ in range(2))
        want = _run_block("torch", q, k, v, qm, km, causal, 0.4)
        got = _run_block("torch_flash", q, k, v, qm, km, causal, 0.4)
        for a, b in zip((want[0], *want[3]), (got[0], *got[3])):
            assert torch.allclose(a, b, atol=1e-5, rtol=0)
        valid = ~torch.isinf(want[1])
        assert torch.equal(valid, ~torch.isinf(got[1]))
        assert torch.allclose(want[1][valid], got[1][valid], atol=1e-5)


def _fake_flash_attn_26_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale,
                                causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                return_softmax=False):
    """flash-attn 2.6's varlen forward contract: 8 outputs, LSE +inf where nothing is seen."""
    assert window_size == (-1, -1) and softcap == 0.0 and not return_softmax
    out, lse = _fake_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, False,
                                   scale=softmax_scale)[:2]
    return out, q, k, v, out, lse, None, None


def _fake_flash_attn_26_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
                                 dropout_p, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, deterministic, rng_state=None):
    """flash-attn 2.6's varlen backward contract: gradients written into dq, dk, dv."""
    grads = _fake_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p,
                                 causal, None, None, scale=softmax_scale)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)


def test_flash_attn_plumbing_with_a_cpu_stand_in(monkeypatch):
    """The flash-attn backend: keyword names of its release, 8-output forward, +inf LSE."""
    monkeypatch.setattr(backends, "_FA_FWD", _fake_flash_attn_26_forward)
    monkeypatch.setattr(backends, "_FA_BWD", _fake_flash_attn_26_backward)
    monkeypatch.setattr(backends, "FLASH_ATTN_AVAILABLE", True)
    monkeypatch.setattr(backends, "supports", lambda name, q: name in ("flash", "torch"))
    qm, km = _random_metas(7)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(qm), 4, 8, generator=gen)
    k, v = (torch.randn(len(km), 2, 8, generator=gen) for _ in range(2))
    want = _run_block("torch", q, k, v, qm, km, True, 0.4)
    got = _run_block("flash", q, k, v, qm, km, True, 0.4)
    for a, b in zip((want[0], *want[3]), (got[0], *got[3])):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert torch.equal(torch.isinf(want[1]), torch.isinf(got[1]))
    assert not (got[1] == float("inf")).any()


def test_group_cache_of_a_shared_token_set_stays_bounded():
    """A model making a new group function per call must not grow a long-lived cache."""
    meta = TokenMeta.contiguous(10)
    assert TokenMeta.contiguous(10) is meta  # shared per length
    for _ in range(3 * kernels._CACHED_GROUPS):
        groups = kernels.attention_groups(lambda p: p // 2, meta)
        decompose(meta, meta, True, groups, groups)
    assert len(meta.cache["groups"]) == kernels._CACHED_GROUPS
    assert len(meta.cache["blocks"]) <= 64
