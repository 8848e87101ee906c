"""``long_sequences`` in training runs (issue 29), single process: the flag's three faces and
its refusals, the driver's plans (in place and made ahead) with the long-sequence choices, the
lockstep rule (a slot's tasks and empty micro-steps share its MLP tiles), the default objective's
tiled loss, and exact tile counts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_cases import (LENGTHS, batch, decoder_config, long_budget_gb, long_choices,  # noqa: E402
                        small_tiles)

from megatron_dcp.config import DCPConfig, DCPConfigError
from megatron_dcp.models.decoder import Decoder
from megatron_dcp.plan import PlanError, build_cost_model, make_plan
from megatron_dcp.plan.memory import assign_long_choices


@pytest.fixture(autouse=True)
def tiles(monkeypatch):
    import megatron_dcp.plan.memory as memory

    monkeypatch.setattr(memory, "MLP_TILE_TOKENS", memory.MLP_TILE_TOKENS)
    monkeypatch.setattr(memory, "LOSS_TILE_BYTES", memory.LOSS_TILE_BYTES)
    small_tiles()


SHAPE = Decoder(decoder_config(), seed=1).shape()


def _config(stage=0, share=None, **kw) -> DCPConfig:
    return DCPConfig(enabled=True, hardware="h200", long_sequences=True,
                     memory_budget_gb=long_budget_gb(SHAPE, 2, stage, share=share), **kw)


def test_flag_faces_and_refusals():
    for style, flag in (("deepspeed", "--dcp_long_sequences"),
                        ("megatron", "--dcp-long-sequences")):
        parser = DCPConfig.add_arguments(argparse.ArgumentParser(), style=style)
        assert DCPConfig.from_args(parser.parse_args(["--dcp", flag])).long_sequences
        with pytest.raises(DCPConfigError, match="without --dcp"):
            DCPConfig.from_args(parser.parse_args([flag]), style=style)
    assert DCPConfig.from_dict({"long_sequences": True}).long_sequences
    with pytest.raises(DCPConfigError, match="long_sequences needs dcp.recompute"):
        DCPConfig(enabled=True, long_sequences=True, recompute="none")
    with pytest.raises(DCPConfigError, match="long_sequences=1"):
        DCPConfig.from_dict({"long_sequences": 1})


def test_only_the_long_task_tiles_and_offloads():
    lengths = [700, 20, 30, 12]
    plan = make_plan(lengths, world_size=2, model=SHAPE, config=_config(), zero_stage=0,
                     long_sequences=True)
    long = [t for t in plan.tasks if 0 in t.seqs]
    short = [t for t in plan.tasks if 0 not in t.seqs]
    assert long[0].mlp_tiles > 1 and long[0].loss_tiles > 1 and long[0].offload_layers > 0
    assert all((t.mlp_tiles, t.loss_tiles, t.offload_layers) == (1, 1, 0) for t in short)
    # without the flag the sequence fits nowhere
    with pytest.raises(PlanError, match="sequence 0 has 700 tokens"):
        make_plan(lengths, world_size=2, model=SHAPE, config=_config().replace(
            long_sequences=False), zero_stage=0)
    # the planner's memory of every task is within the budget
    cm = build_cost_model(SHAPE, _config(), 2, zero_stage=0, long_sequences=True)
    for t in plan.tasks:
        assert cm.memory_model.task_memory(t, plan.lengths) <= cm.memory_model.budget
    from megatron_dcp.plan import validate_plan

    validate_plan(plan, SHAPE, cost_model=cm)  # lengthened tasks retimed: no rank overlaps


def test_assigning_twice_changes_nothing_and_loss_tiling_off_keeps_loss_whole():
    cm = build_cost_model(SHAPE, _config(), 2, zero_stage=0, long_sequences=True)
    plan = make_plan(list(LENGTHS), world_size=2, model=SHAPE, config=_config(), zero_stage=0,
                     cost_model=cm)
    assert long_choices(plan)["offload_layers"] > 0
    again = assign_long_choices(plan, cm.memory_model)
    assert again.digest() == plan.digest() and again.tasks == plan.tasks
    whole = make_plan(list(LENGTHS), world_size=2, model=SHAPE, zero_stage=0,
                      config=_config(share=0.1), long_sequences=True, loss_tiling=False)
    choices = long_choices(whole)
    assert choices["loss_tiles"] == 1 and choices["mlp_tiles"] > 1


def test_lockstep_slots_share_their_mlp_tiles_and_empty_steps_run_them():
    from megatron_dcp.runtime.executor import _rank_order

    lengths = [700, 300, 40, 20, 90, 7, 130, 650, 5]
    plan = make_plan(lengths, world_size=2, model=SHAPE, config=_config(stage=3), zero_stage=3,
                     long_sequences=True)
    assert plan.lockstep and long_choices(plan)["mlp_tiles"] > 1
    slots = plan.slot_mlp_tiles()
    for t in plan.tasks:
        assert t.mlp_tiles == slots[t.slot]
    for rank in range(2):
        tiles = [tiles for _, _, tiles in _rank_order(plan, rank)]
        assert tiles == slots  # one micro-step per slot, each with its slot's tiles


def test_driver_plans_with_long_choices_in_place_and_ahead():
    from megatron_dcp.runtime.step import StepDriver

    pool = SimpleNamespace(world_size=2, rank=0, job_group=None)
    driver = StepDriver(_config(), pool=pool, model_shape=SHAPE)
    assert long_choices(driver.plan(list(LENGTHS)))["mlp_tiles"] > 1
    assert driver.plan_ahead(list(LENGTHS))
    made = driver._ahead.take(driver._plan_key(list(LENGTHS), None, driver.iteration))
    assert long_choices(made[0])["offload_layers"] > 0
    driver.close()
    whole = StepDriver(_config(share=0.1), pool=pool, model_shape=SHAPE, loss_tiling=False)
    assert long_choices(whole.plan(list(LENGTHS)))["loss_tiles"] == 1


def test_pipelines_and_megatron_flags_refuse_what_they_cannot_run():
    from dataclasses import replace

    from test_megatron_args import megatron_like_parser

    from megatron_dcp.megatron.args import DCPArgumentError, validate_dcp_args

    with pytest.raises(PlanError, match="long_sequences with pipeline parallelism"):
        make_plan(list(LENGTHS), world_size=2, model=replace(SHAPE, pipeline_parallel=2),
                  config=_config(), long_sequences=True)
    parser = megatron_like_parser()
    parser.add_argument("--num-experts", type=int, default=None)
    parser.add_argument("--distribute-saved-activations", action="store_true")
    parser.add_argument("--mtp-num-layers", type=int, default=None)
    line = "--dcp --dcp-long-sequences --calculate-per-token-loss"
    assert validate_dcp_args(parser.parse_args(line.split()), world_size=2).long_sequences
    for extra, flag in (("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size"),
                        ("--num-experts 4", "--num-experts"),
                        ("--mtp-num-layers 1", "--mtp-num-layers"),
                        ("--distribute-saved-activations", "--distribute-saved-activations")):
        with pytest.raises(DCPArgumentError, match=f"--dcp-long-sequences with {flag}"):
            validate_dcp_args(parser.parse_args(f"{line} {extra}".split()), world_size=4)


def _shard(tiles: int):
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime.context import TaskContext
    from megatron_dcp.runtime.executor import Shard
    from megatron_dcp.runtime.layout import ShardLayout

    seq = batch(0)[1]
    layout = ShardLayout.build([seq.numel()], 1, 1, 0)
    task = Task(id=0, ranks=(0,), seqs=(0,), recompute_layers=6, loss_tiles=tiles,
                mlp_tiles=tiles)
    ctx = TaskContext(task=task, group_rank=0, layout=layout, recompute_layers=6)
    labels = torch.cat([seq[1:], torch.tensor([-100])])
    return Shard(seq, layout.position_ids, labels, ctx)


def test_default_objective_tiles_the_loss_inside_the_forward():
    from deepspeed_plugin.engine import check_takes_labels, token_loss

    model = Decoder(decoder_config(), seed=3)
    calls = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append(sorted(k)), with_kwargs=True)
    whole, tiled = token_loss(model, _shard(1)), token_loss(model, _shard(3))
    assert calls == [["task"], ["labels", "task"]]  # the tiled loss inside the forward
    assert torch.allclose(whole, tiled, rtol=1e-6, atol=1e-6)
    check_takes_labels(model)

    class NoLabels(torch.nn.Module):
        def forward(self, input_ids, position_ids=None, task=None):
            return input_ids

    with pytest.raises(TypeError, match="NoLabels.forward takes no 'labels'"):
        check_takes_labels(NoLabels())


def test_a_tile_count_above_the_tokens_runs_empty_tiles():
    from megatron_dcp.runtime.tiling import tiled_mlp

    calls = []
    w = torch.randn(4, 4, requires_grad=True)

    def fn(x):
        calls.append(x.shape[0])
        return x @ w

    x = torch.randn(3, 4, requires_grad=True)
    out = tiled_mlp(fn, x, 5)
    assert calls == [1, 1, 1, 0, 0] and torch.allclose(out, x @ w)
    out.sum().backward()  # the empty tiles recompute too
    assert sorted(calls[5:]) == [0, 0, 1, 1, 1]


def test_a_lockstep_slot_with_two_mlp_tile_counts_is_refused():
    from dataclasses import replace

    from megatron_dcp.plan import validate_plan

    plan = make_plan([700, 300, 40, 20, 90, 7, 130, 650, 5], world_size=2, model=SHAPE,
                     config=_config(stage=3), zero_stage=3, long_sequences=True)
    validate_plan(plan, SHAPE)
    slot = next(t.slot for t in plan.tasks
                if sum(u.slot == t.slot for u in plan.tasks) > 1)
    first = next(t for t in plan.tasks if t.slot == slot)
    bad = replace(plan, tasks=tuple(replace(t, mlp_tiles=t.mlp_tiles + 1) if t is first else t
                                    for t in plan.tasks))
    with pytest.raises(PlanError, match="the tasks of a slot run as many MLP tiles"):
        validate_plan(bad, SHAPE)


def test_the_fits_no_group_error_names_long_sequences_where_they_would_fit():
    """Issue 45, item 6: a sequence that fits no group with long sequences off, but would with
    them on, gets an error that names the flag and what a tiled, offloaded task holds; one too
    long for them too gets no such hint."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import load_model, make_plan
    from megatron_dcp.plan.plan import PlanError

    config = DCPConfig(enabled=True, hardware="h200", memory_budget_gb=80)
    with pytest.raises(PlanError, match=r"turn on dcp.long_sequences \(--dcp-long-sequences\)"):
        make_plan([200000, 1000], world_size=2, model=load_model("llama-7b"), config=config)
    plan = make_plan([200000, 1000], world_size=2, model=load_model("llama-7b"),
                     config=config, long_sequences=True)
    assert plan.tasks[0].mlp_tiles > 1
    with pytest.raises(PlanError) as err:
        make_plan([30_000_000], world_size=2, model=load_model("llama-7b"), config=config)
    assert "long_sequences" not in str(err.value)


def test_auto_plans_long_choices_only_for_a_batch_that_needs_them():
    """``long_sequences="auto"`` (the default): a batch whose sequences fit plainly gets the plan
    it gets with long sequences off (same digest), a batch with a sequence that fits no group
    gets the long-sequence choices (off: the fits-no-group error)."""
    from megatron_dcp.runtime.step import StepDriver

    pool = SimpleNamespace(world_size=2, rank=0, job_group=None)
    auto = StepDriver(_config().replace(long_sequences="auto"), pool=pool, model_shape=SHAPE)
    off = StepDriver(_config().replace(long_sequences="off"), pool=pool, model_shape=SHAPE)
    assert DCPConfig().long_sequences == "auto"
    short = [150, 20, 30, 12, 90]
    assert not auto.long_plan(short, 2)
    assert auto.plan(short).digest() == off.plan(short).digest()
    assert auto.long_plan(list(LENGTHS), 2)
    assert long_choices(auto.plan(list(LENGTHS)))["mlp_tiles"] > 1
    with pytest.raises(PlanError, match="fits no group"):
        off.plan(list(LENGTHS))
    # the capacity is the largest group's with every layer recomputed, less one padding step:
    # the longest sequence below it plans without long choices
    capacity = auto._plain_capacity[2]
    assert not auto.long_plan([capacity], 2) and auto.long_plan([capacity + 1], 2)
    assert long_choices(auto.plan([capacity, 20])) == long_choices(off.plan([capacity, 20]))


def test_auto_faces_and_where_it_turns_off():
    from test_megatron_args import megatron_like_parser

    from megatron_dcp.megatron.args import validate_dcp_args

    for style, flag in (("deepspeed", "--dcp_long_sequences"),
                        ("megatron", "--dcp-long-sequences")):
        parser = DCPConfig.add_arguments(argparse.ArgumentParser(), style=style)
        for given, mode in (([], "auto"), ([flag], "on"), ([flag, "off"], "off"),
                            ([flag, "auto"], "auto")):
            config = DCPConfig.from_args(parser.parse_args(["--dcp", *given]), style=style)
            assert config.long_sequences == mode, (style, given)
    assert DCPConfig.from_dict({"long_sequences": False}).long_sequences == "off"
    assert DCPConfig(recompute="none").long_sequences == "off"  # a long task recomputes
    parser = megatron_like_parser()
    parser.add_argument("--num-experts", type=int, default=None)
    line = "--dcp --calculate-per-token-loss".split()
    assert validate_dcp_args(parser.parse_args(line), world_size=2).long_sequences == "auto"
    for extra in ("--pipeline-model-parallel-size 2", "--num-experts 4"):  # off, no error
        args = parser.parse_args(line + extra.split())
        assert validate_dcp_args(args, world_size=4).long_sequences == "off"


def test_deepspeed_auto_turns_off_without_a_tiled_loss():
    import deepspeed_plugin

    class NoLabels(torch.nn.Module):
        def forward(self, input_ids, position_ids, task=None):
            return input_ids

    config = DCPConfig(enabled=True)
    decoder = Decoder(decoder_config(), seed=1)
    assert deepspeed_plugin._prepared_model(decoder, None, config)[1].long_sequences == "auto"
    assert deepspeed_plugin._prepared_model(NoLabels(), None, config)[1].long_sequences == "off"
    custom = deepspeed_plugin._prepared_model(decoder, lambda *a: a, config)[1]
    assert custom.long_sequences == "off"
