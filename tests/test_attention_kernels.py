"""Single-process tests of the block kernels: chunking, log-sum-exp merging, block backward."""

import math

import pytest
import torch

from megatron_dcp.runtime import kernels
from megatron_dcp.runtime.layout import ShardLayout, TokenMeta
from test_attention import reference


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ring", [2, 3])
def test_blocks_merge_to_full_attention(monkeypatch, causal, ring):
    """Split keys into zigzag ring portions; merged forward and summed block grads are exact."""
    monkeypatch.setattr(kernels, "SCORE_BLOCK", 1)  # 16-row query chunks
    lengths = (11, 4, 17)
    metas = [ShardLayout.build(lengths, 1, ring, j).meta() for j in range(ring)]
    qmeta = TokenMeta(*(torch.cat([getattr(m, f) for m in metas])
                        for f in ("positions", "seq_ids", "valid")))
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
    with torch.no_grad():
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


def test_backend_choice_is_reported_and_forcible():
    assert kernels.selected_backend() in kernels.BACKENDS
    with kernels.forced_backend("torch"):
        assert kernels.selected_backend() == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        with kernels.forced_backend("cudnn"):
            pass


def test_float32_computes_lse_in_float32():
    meta = TokenMeta.contiguous(7)
    q = torch.randn(7, 2, 4, dtype=torch.bfloat16)
    out, lse = kernels.block_forward(q, q, q, meta, meta, causal=True, scale=0.5)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


def _ring_blocks(lengths, ulysses, ring, causal, backend, dtype=torch.float64):
    """Merged out/lse and per-block grads of every ring rank, computed with ``backend``."""
    lay = ShardLayout.build(lengths, ulysses, ring, 0)
    metas = [lay.portion(j) for j in range(ring)]
    gen = torch.Generator().manual_seed(1)
    data = [[torch.randn(len(m), h, 8, generator=gen, dtype=dtype) for h in (4, 2, 2, 4)]
            for m in metas]
    results = []
    with kernels.forced_backend(backend), torch.no_grad():
        for j in range(ring):
            q, dout = data[j][0], data[j][3]
            out = lse = None
            for src in range(ring):
                o, l = kernels.block_forward(q, data[src][1], data[src][2], metas[j], metas[src],
                                             causal=causal, scale=0.3)
                out, lse = kernels.merge_block(out, lse, o, l)
            grads = [kernels.block_backward(dout, q, data[src][1], data[src][2], out, lse,
                                            metas[j], metas[src], causal=causal, scale=0.3)
                     for src in range(ring)]
            results.append((out, lse, grads))
    return metas, results


@pytest.mark.parametrize("lengths,ulysses,ring", [((13, 6, 21), 1, 2), ((40, 9), 1, 3),
                                                  ((32, 11), 2, 2), ((5,), 1, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_pairs_match_exact_blocks(lengths, ulysses, ring, causal):
    """Zigzag blocks decompose into full/diagonal run pairs; the fused path equals the exact."""
    metas, exact = _ring_blocks(lengths, ulysses, ring, causal, "torch")
    for j in range(ring):
        for src in range(ring):
            assert kernels._pairs_mod.run_pairs(metas[j], metas[src], causal) is not None
    if not kernels._pairs_mod.available(torch.device("cpu")):
        pytest.skip("no fused CPU attention op in this torch")
    _, fused = _ring_blocks(lengths, ulysses, ring, causal, "sdpa")
    for (o1, l1, g1), (o2, l2, g2) in zip(exact, fused):
        assert torch.allclose(o1, o2, atol=1e-12, rtol=0)
        assert torch.equal(torch.isinf(l1), torch.isinf(l2))
        assert torch.allclose(l1[~torch.isinf(l1)], l2[~torch.isinf(l2)], atol=1e-12, rtol=0)
        for a, b in zip(g1, g2):
            for x, y in zip(a, b):
                assert torch.allclose(x, y, atol=1e-12, rtol=0)
