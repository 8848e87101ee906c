"""Planner side of issue 29: optimizer/parameter offload in the static memory, per-task tiles
and offloaded layers where nothing plain fits, none for short sequences; the simulated targets
(Llama-3-8B shape, h100, ZeRO-3, optimizer offload)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan.memory import assign_long_choices
from megatron_dcp.plan.planner import build_cost_model, make_plan
from megatron_dcp.plan.plan import PlanError
from megatron_dcp.plan.presets import MODEL_PRESETS
from megatron_dcp.plan.simulate import lower_bound, simulate

LLAMA3 = dataclasses.replace(MODEL_PRESETS["llama-7b"], ffn_hidden_size=14336, vocab_size=128256,
                             num_kv_heads=8, name="llama3-8b", max_position=None)
CONFIG = DCPConfig(hardware="h100")


def _plan(lengths, world, **kw):
    cm = build_cost_model(LLAMA3, CONFIG, world, zero_stage=3, **kw)
    plan = make_plan(lengths, world_size=world, model=LLAMA3, config=CONFIG, zero_stage=3,
                     cost_model=cm)
    return assign_long_choices(plan, cm.memory_model), cm


def test_offload_optimizer_lowers_static_memory():
    plain = build_cost_model(LLAMA3, CONFIG, 8, zero_stage=3).memory_model
    off = build_cost_model(LLAMA3, CONFIG, 8, zero_stage=3, offload_optimizer=True).memory_model
    p = plain.geometry.params
    # Adam states 12 B and bf16 gradient partitions 2 B per parameter / 8 ranks leave the GPU
    assert plain.static_memory - off.static_memory == pytest.approx(14 * p / 8)
    both = build_cost_model(LLAMA3, CONFIG, 8, zero_stage=3, offload_optimizer=True,
                            offload_param=True).memory_model
    assert off.static_memory - both.static_memory == pytest.approx(2 * p / 8)
    with pytest.raises(PlanError, match="below the static memory"):
        build_cost_model(LLAMA3, CONFIG, 1, zero_stage=3)
    with pytest.raises(PlanError, match="offload_param needs ZeRO stage 3"):
        build_cost_model(LLAMA3, CONFIG, 8, zero_stage=1, offload_param=True)


def test_480k_on_one_gpu_needs_every_choice():
    with pytest.raises(PlanError):
        _plan([480_000], 1, offload_optimizer=True)  # no tiles, no activation offload
    plan, cm = _plan([480_000], 1, offload_optimizer=True, long_sequences=True)
    (task,) = plan.tasks
    assert task.recompute_layers == 32 and task.offload_layers > 0
    assert task.mlp_tiles > 1 and task.loss_tiles > 1
    assert task.memory <= cm.memory_model.budget
    assert cm.memory_model.task_memory(task, plan.lengths) == task.memory


def test_mixed_batch_short_sequences_pay_nothing():
    lengths = [3_700_000] + [4096] * 200 + [32768] * 20
    plan, cm = _plan(lengths, 8, offload_optimizer=True, long_sequences=True)
    long = [t for t in plan.tasks if 0 in t.seqs]
    assert len(long) == 1 and long[0].offload_layers > 0 and long[0].mlp_tiles > 1
    for t in plan.tasks:
        if 0 not in t.seqs:
            assert (t.mlp_tiles, t.loss_tiles, t.offload_layers) == (1, 1, 0)
    bound = lower_bound([lengths[s] for t in plan.tasks for s in t.seqs], cm, world_size=8)
    result = simulate(plan, cm, bound=bound)
    assert result.efficiency >= 0.95


def test_offload_time_hidden_or_charged():
    mm = build_cost_model(LLAMA3, CONFIG, 1, zero_stage=3, offload_optimizer=True).memory_model
    # 32 layers x 100K tokens x 8 KiB each way at 50 GB/s: 1.05 s; 0.2 s of compute hides a part
    exposed = mm.offload_seconds(100_000, 1, 32, hidden_s=0.2)
    assert exposed == pytest.approx(2 * 32 * 100_000 * 8192 / 50e9 - 0.2)
    assert mm.offload_seconds(100_000, 1, 32, hidden_s=10.0) == 0.0
    assert mm.tiling_seconds(1, 1) == 0.0 and mm.tiling_seconds(4, 2) > 0
