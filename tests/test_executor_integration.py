"""The README's "Integrate DCP into your own model" as a test: a model of one's own, planned by
make_plan, two optimizer steps on 2 ranks, equal to single-process training on the same global
batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_distributed
from megatron_dcp.runtime.attention import dcp_attention
from megatron_dcp.runtime.recompute import run_layer

pytestmark = pytest.mark.slow  # every test here launches processes


class TinyGPT(nn.Module):
    """A user's model: learned absolute positions, LayerNorm, GELU MLP; its forward takes the
    task and hands it to the two DCP calls."""

    def __init__(self, vocab=40, dim=16, heads=2, layers=2, max_len=64):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(dim), qkv=nn.Linear(dim, 3 * dim), proj=nn.Linear(dim, dim),
            ln2=nn.LayerNorm(dim), mlp=nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                     nn.Linear(4 * dim, dim))))
            for _ in range(layers))
        self.out = nn.Linear(dim, vocab)

    def block(self, b, x, task):
        t = x.shape[0]
        q, k, v = b["qkv"](b["ln1"](x)).view(t, 3, self.heads, -1).unbind(1)
        x = x + b["proj"](dcp_attention(q, k, v, causal=True, task=task).reshape(t, -1))  # DCP 1
        return x + b["mlp"](b["ln2"](x))

    def forward(self, ids, pos, task=None):
        x = self.tok(ids) + self.pos(pos)
        for i, b in enumerate(self.blocks):
            x = run_layer(i, lambda y, b=b: self.block(b, y, task), x, task=task)      # DCP 2
        return self.out(x)


def loss_sum(model, ids, pos, labels, task=None):
    return F.cross_entropy(model(ids, pos, task), labels, ignore_index=-100, reduction="sum")


def batches():
    gen = torch.Generator().manual_seed(3)
    for lengths in ([50, 7, 13, 4, 21, 9], [33, 40, 2, 11]):
        yield [torch.randint(0, 40, (n,), generator=gen) for n in lengths]


def _train(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from megatron_dcp import DCPConfig
    from megatron_dcp.plan import CostModel, load_hardware, make_plan
    from megatron_dcp.plan.memory import RESERVE_BYTES
    from megatron_dcp.plan.model import ModelShape
    from megatron_dcp.runtime.executor import reduce_gradients, run_plan
    from megatron_dcp.runtime.groups import GroupPool

    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    shape = ModelShape(num_layers=2, hidden_size=16, num_heads=2, ffn_hidden_size=64,
                       vocab_size=40, gated_mlp=False, max_position=64)
    # A tight memory budget so the long sequences need 2 ranks and recomputation.
    base = CostModel(shape, load_hardware("h200"), world_size=world_size)
    cm = CostModel(shape, base.hw, world_size=world_size,
                   memory_budget=base.memory_model.static_memory + RESERVE_BYTES
                   + 30 * base.memory_model.token_bytes(0))
    cfg = DCPConfig(enabled=True)
    pool = GroupPool()
    losses, degrees = [], []
    for step, batch in enumerate(batches()):
        plan = make_plan([len(s) for s in batch], world_size=dist.get_world_size(), model=shape,
                         config=cfg, iteration=step, cost_model=cm)
        stats = run_plan(plan, batch, dist.get_rank(),
                         lambda s: loss_sum(model, s.input_ids, s.position_ids, s.labels, s.task),
                         pool=pool, max_position=64)
        reduce_gradients(model.parameters(), pool.world_group)
        opt.step()
        opt.zero_grad()
        losses.append(stats.loss)
        degrees.append(sorted({t.degree for t in plan.tasks}))
    return dict(losses=losses, degrees=degrees,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.mark.timeout(120)
def test_own_model_two_steps_match_single_process():
    results = run_distributed(_train, 2)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_losses = []
    for batch in batches():
        total = sum(len(s) - 1 for s in batch)
        loss = sum(loss_sum(model, s, torch.arange(len(s)),
                            torch.cat([s[1:], torch.tensor([-100])])) for s in batch) / total
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    assert 2 in results[0]["degrees"][0], results[0]["degrees"]  # the plan really used 2 ranks
    for res in results:
        for got, ref in zip(res["losses"], ref_losses):
            assert abs(got - ref) <= 1e-5 * ref, (res["losses"], ref_losses)
        for n, p in model.named_parameters():
            err = float((res["params"][n] - p.detach()).norm() / p.detach().norm())
            assert err <= 1e-5, (n, err)
