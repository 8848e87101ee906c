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
