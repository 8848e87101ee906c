"""The cost model's ring P2P volume is what `RingAttention` really sends (bf16 K/V blocks, fp32
dK/dV partial sums), counted on an in-process ring of threads."""

import queue
import threading

import pytest
import torch

from megatron_dcp.plan import CostModel, load_hardware
from megatron_dcp.plan.cost import Layout
from megatron_dcp.plan.presets import load_model
from megatron_dcp.runtime.layout import ShardLayout
from megatron_dcp.runtime.ring import ring_attention


class _Done:
    def __init__(self, fill):
        self.fill = fill

    def wait(self):
        self.fill()


class ThreadRing:
    """`RingComm`'s interface over queues between threads; logs the bytes each rank sends."""

    def __init__(self, rank, size, boxes, sent):
        self.rank, self.size, self.boxes, self.sent = rank, size, boxes, sent
        self.next = (rank + 1) % size

    def shift(self, x, tag):
        self.sent[self.rank][tag] = self.sent[self.rank].get(tag, 0) + x.numel() * x.element_size()
        self.boxes[(self.next, tag)].put(x.clone())
        buf = torch.empty_like(x)
        return [_Done(lambda: buf.copy_(self.boxes[(self.rank, tag)].get(timeout=30)))], buf


@pytest.mark.parametrize("ring", [2, 3])
def test_cost_model_counts_the_ring_bytes_sent(ring):
    lengths, hq, hkv, dim = (40, 22), 4, 2, 8
    metas = [ShardLayout.build(lengths, 1, ring, 0).portion(j) for j in range(ring)]
    boxes = {(j, t): queue.Queue() for j in range(ring) for t in (11, 12)}
    sent = [{} for _ in range(ring)]
    errors = []

    def run(j):
        try:
            gen = torch.Generator().manual_seed(j)
            n = len(metas[j])
            q = torch.randn(n, hq, dim, generator=gen).bfloat16().requires_grad_()
            k, v = (torch.randn(n, hkv, dim, generator=gen).bfloat16().requires_grad_()
                    for _ in range(2))
            out = ring_attention(q, k, v, ThreadRing(j, ring, boxes, sent), metas, causal=True,
                                 scale=dim ** -0.5)
            out.float().sum().backward()
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(j,)) for j in range(ring)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors

    model = load_model("llama-7b")
    hw = load_hardware("h200")
    cm = CostModel(model, hw, world_size=ring)
    kv_dim = cm.kv_dim
    # s per local token, no recompute
    rate = cm.time_model._rates_for(Layout(1, ring, True, True), 0).p2p
    model_bytes_per_token_layer = rate * hw.intra_bandwidth / model.num_layers
    # the same quantity measured, scaled from this toy's K/V width to the model's
    tokens = len(metas[0])
    measured = sum(sent[0].values()) / tokens / (hkv * dim) * kv_dim
    assert measured == pytest.approx(model_bytes_per_token_layer, rel=1e-9)
