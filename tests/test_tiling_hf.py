"""Tiled MLP, tiled loss and activation offload through the HF wrapper (issue 29): the same
losses and gradients as the untiled wrapper, backward on a fresh thread; at 2 ranks through the
step driver, the same gradients as single-process training."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distributed import run_distributed  # noqa: E402
from executor_cases import make_batch, on_fresh_thread, plan_dict, rel_err  # noqa: E402
from executor_cases import task as make_task  # noqa: E402
from test_hf import COMMON, build, reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

LENGTHS = (29, 7, 13, 18, 3, 22)


def _ctx(lengths, **choice):
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime.context import TaskContext
    from megatron_dcp.runtime.layout import ShardLayout

    task = Task(id=0, ranks=(0,), seqs=tuple(range(len(lengths))),
                recompute_layers=choice.pop("recompute", 0), **choice)
    return TaskContext(task=task, group_rank=0, layout=ShardLayout.build(lengths, 1, 1, 0),
                       recompute_layers=task.recompute_layers)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_wrapper_tiles_and_offloads_exactly(kind, monkeypatch):
    from megatron_dcp.integrations.hf import DCPCausalLM
    from megatron_dcp.runtime import offload

    model = DCPCausalLM(build(kind))
    model.train()
    lengths = [21, 14]
    seqs = make_batch(lengths, COMMON["vocab_size"])
    ids = torch.cat(seqs)
    labels = torch.cat([torch.cat([s[1:], torch.tensor([-100])]) for s in seqs])
    mlp_rows = []
    for layer in model.causal_lm.model.layers:
        layer.mlp.down_proj.register_forward_pre_hook(
            lambda m, a: mlp_rows.append(a[0].shape[-2]))
    puts = []
    real = offload.HostStash.put
    monkeypatch.setattr(offload.HostStash, "put", lambda s, x: puts.append(1) or real(s, x))

    def run(**choice):
        model.zero_grad()
        mlp_rows.clear()
        ctx = _ctx(lengths, **choice)
        losses = model.token_losses(ids, ctx.layout.position_ids, labels, task=ctx)
        on_fresh_thread(losses.sum().backward)
        return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = run()
    assert max(mlp_rows) == sum(lengths)
    got = run(mlp_tiles=4, loss_tiles=3, recompute=2, offload_layers=1)
    assert max(mlp_rows) == 9 and len(puts) == 1  # tiles of 35 tokens; one layer offloaded
    assert rel_err(got[0], ref[0]) <= 1e-6
    for n, g in ref[1].items():
        assert rel_err(got[1][n], g) <= 1e-6, n
    same = run(recompute=2, offload_layers=2)
    recomputed = run(recompute=2)
    for n, g in recomputed[1].items():
        assert torch.equal(same[1][n], g), n


def _body(rank, world_size, plan):
    from plain_torch import TorchEngine

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.integrations.hf import DCPCausalLM
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    pool = GroupPool()
    model = DCPCausalLM(build("llama"))
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), pool.world_group)
    engine.backward = lambda loss, last: on_fresh_thread(loss.backward)
    driver = StepDriver(DCPConfig(enabled=True), pool=pool, model_shape=model.shape())
    result = driver.step(engine, make_batch(LENGTHS, COMMON["vocab_size"]), Plan.from_dict(plan))
    return result.loss, ({n: p.grad.clone() for n, p in model.named_parameters()}
                         if rank == 0 else None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_tiled_offloaded_plan_at_two_ranks():
    import dataclasses

    plan = plan_dict([
        dataclasses.replace(make_task(0, (0, 1), (0,), ulysses=2, recompute_layers=2, start=0.0),
                            mlp_tiles=3, offload_layers=2),
        dataclasses.replace(make_task(1, (1, 0), (3, 4), recompute_layers=1, start=1.0),
                            mlp_tiles=2, offload_layers=1),
        make_task(2, (0,), (1, 2), start=2.0),
        dataclasses.replace(make_task(3, (1,), (5,), start=2.0), mlp_tiles=5),
    ], LENGTHS, 2)
    results = run_distributed(_body, world_size=2, args=(plan,), timeout_s=280)
    ref_loss, ref_grads = reference("llama")
    for loss, _ in results:
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for n, g in ref_grads.items():
        assert rel_err(results[0][1][n], g) <= 1e-5, n


def test_wrapper_tiles_the_loss_in_its_forward_for_the_default_objective():
    """``DCPCausalLM.forward(..., labels=)`` (what `deepspeed_plugin.token_loss` calls for a
    task with loss tiles, inside the module's forward: ZeRO-3) equals the untiled loss."""
    from deepspeed_plugin.engine import check_takes_labels, token_loss
    from megatron_dcp.integrations.hf import DCPCausalLM
    from megatron_dcp.runtime.executor import Shard

    model = DCPCausalLM(build("llama"))
    model.train()
    check_takes_labels(model)
    lengths = [21, 14]
    seqs = make_batch(lengths, COMMON["vocab_size"])
    ids = torch.cat(seqs)
    labels = torch.cat([torch.cat([s[1:], torch.tensor([-100])]) for s in seqs])
    out = []
    for tiles in (1, 4):
        ctx = _ctx(lengths, loss_tiles=tiles, mlp_tiles=tiles, recompute=2)
        model.zero_grad()
        losses = token_loss(model, Shard(ids, ctx.layout.position_ids, labels, ctx))
        on_fresh_thread(losses.sum().backward)
        out.append((losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.allclose(out[0][0], out[1][0], rtol=1e-6, atol=1e-6)
    for name, g in out[0][1].items():
        assert rel_err(out[1][1][name], g) <= 1e-6, name
