"""Lockstep plans (pure Python): the planner picks them for ZeRO-2/3, every slot has one recompute
depth and at most one task per rank, the memory model shards what ZeRO-2/3 shard, the simulator
times slot after slot, and the plan JSON keeps free plans as they were."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace

import pytest

from megatron_dcp.config import DCPConfig, DCPConfigError
from megatron_dcp.plan import (PlanError, build_cost_model, load_model, make_plan, simulate,
                               validate_plan)
from megatron_dcp.plan.plan import EMPTY_STEP_TOKENS, Plan, Task
from megatron_dcp.plan.schedule import memory_stage, schedule_for
from megatron_dcp.plan.workload import sample_lengths

LLAMA = load_model("llama-7b")


def _slots(plan: Plan) -> dict[int, list[Task]]:
    out = defaultdict(list)
    for t in plan.tasks:
        out[t.slot].append(t)
    return out


def test_schedule_follows_the_zero_stage_unless_forced():
    assert [schedule_for("auto", z) for z in range(4)] == ["free", "free", "lockstep",
                                                           "lockstep"]
    assert schedule_for("free", 3) == "free" and schedule_for("lockstep", 0) == "lockstep"
    # a free schedule under ZeRO-2/3 holds what ZeRO-1 holds (coalesced gradient, gathered
    # parameters); lockstep keeps the stage's sharding
    assert [memory_stage(z, "free") for z in range(4)] == [0, 1, 1, 1]
    assert [memory_stage(z, "lockstep") for z in range(4)] == [0, 1, 2, 3]
    with pytest.raises(DCPConfigError, match="dcp.schedule='sometimes'"):
        DCPConfig(schedule="sometimes")
    lengths = sample_lengths("short", 8 * 65536, seed=1)
    for zero, config, lockstep in ((1, DCPConfig(), False), (2, DCPConfig(), True),
                                   (3, DCPConfig(), True), (3, DCPConfig(schedule="free"), False),
                                   (1, DCPConfig(schedule="lockstep"), True)):
        plan = make_plan(lengths, world_size=8, model=LLAMA, config=config, zero_stage=zero)
        assert plan.lockstep == lockstep and plan.meta["zero_stage"] == zero
        assert plan.meta["schedule"] == ("lockstep" if lockstep else "free")


@pytest.mark.parametrize("policy", ["dcp", "dcp-inter", "dcp-intra", "bucket", "packed",
                                    "static", "greedy-cp"])
@pytest.mark.parametrize("dist", ["short", "long"])
def test_lockstep_plans_are_valid_one_depth_per_slot_and_timed_by_slot(policy, dist):
    world = 16
    lengths = sample_lengths(dist, world * 65536, seed=3)
    config = DCPConfig(policy=policy)
    cm = build_cost_model(LLAMA, config, world, zero_stage=3)
    plan = make_plan(lengths, world_size=world, model=LLAMA, config=config, zero_stage=3)
    validate_plan(plan, LLAMA, cost_model=cm)  # memory of the sharded ZeRO-3 model
    assert plan.lockstep and all(t.slot is not None for t in plan.tasks)
    slots = _slots(plan)
    assert sorted(slots) == list(range(len(slots)))  # no empty slot
    clock = 0.0
    for k in sorted(slots):
        tasks = slots[k]
        assert len({t.recompute_layers for t in tasks}) == 1
        ranks = [r for t in tasks for r in t.ranks]
        assert len(ranks) == len(set(ranks))
        assert all(t.start == pytest.approx(clock) for t in tasks)
        clock += max(max(cm.time_model.task_time(t, plan.lengths) for t in tasks),
                     cm.time_model.slot_time(tasks[0].recompute_layers))
    result = simulate(plan, cm)
    assert result.makespan_s == pytest.approx(clock)
    assert result.makespan_s >= plan.makespan * (1 - 1e-9)  # the last slot's floor on top


def test_dcp_lockstep_is_never_slower_than_the_lockstep_baselines():
    world = 16
    lengths = sample_lengths("balanced", world * 65536, seed=5)
    cm = build_cost_model(LLAMA, DCPConfig(), world, zero_stage=3)
    times = {p: simulate(make_plan(lengths, world_size=world, model=LLAMA,
                                   config=DCPConfig(policy=p), zero_stage=3), cm).step_time_s
             for p in ("dcp", "bucket", "packed", "static", "greedy-cp")}
    assert all(times["dcp"] <= t * (1 + 1e-9) for t in times.values()), times


def test_sharded_memory_lets_llama_70b_plan_where_free_schedules_cannot():
    model = load_model("llama-70b")
    lengths = sample_lengths("long", 256 * 65536, seed=0)
    # a free schedule under ZeRO-3 keeps the parameters gathered: 140 GB of bf16 weights
    with pytest.raises(PlanError, match="below the static memory"):
        make_plan(lengths, world_size=256, model=model, config=DCPConfig(schedule="free"),
                  zero_stage=3)
    cm = build_cost_model(model, DCPConfig(), 256, zero_stage=3)
    free = build_cost_model(model, DCPConfig(memory_budget_gb=1e4), 256, zero_stage=1)
    comm = cm.memory_model.communicators.bytes  # the same in both
    assert comm == free.memory_model.communicators.bytes
    assert cm.memory_model.static_memory - comm < (free.memory_model.static_memory - comm) / 20
    # parameters, gradients and states sharded, plus the layers gathered at a time and a bucket
    assert cm.memory_model.static_memory - comm > 16 * cm.params / 256 + 2 * 2 * cm.layer_params
    plan = make_plan(lengths, world_size=256, model=model, config=DCPConfig(), zero_stage=3,
                     cost_model=cm)
    validate_plan(plan, model, cost_model=cm)
    assert plan.lockstep and max(t.memory for t in plan.tasks) <= cm.memory_model.budget


def test_slot_time_is_zero3_traffic_when_it_dominates():
    world = 64
    z3 = build_cost_model(LLAMA, DCPConfig(), world, zero_stage=3)
    z2 = build_cost_model(LLAMA, DCPConfig(), world, zero_stage=2)
    assert z3.time_model.slot_time(32) > z3.time_model.slot_time(0) > z2.time_model.slot_time(0) > 0
    # stage 3: three passes of the parameters (gathers in forward and backward, the gradients'
    # reduce-scatter) over the inter-node links, a fourth with every layer recomputed
    share = (world - 1) / world * 2 * z3.params / z3.hw.inter_bandwidth
    assert z3.time_model.slot_time(0) == pytest.approx(3 * share)
    assert z3.time_model.slot_time(32) == pytest.approx(4 * share)
    z1 = build_cost_model(LLAMA, DCPConfig(), 8, zero_stage=1)
    empty = z1.time_model.time_of(EMPTY_STEP_TOKENS, z1.attn_pairs(EMPTY_STEP_TOKENS),
                                  z1.layouts(1)[0], 0)
    assert z1.time_model.slot_time(0) == pytest.approx(empty)


def _plan(tasks) -> Plan:
    return Plan(tasks=tuple(tasks), lengths=(10, 20, 30, 40), world_size=2, policy="manual")


GOOD = [Task(0, (0, 1), (0,), ulysses=2, recompute_layers=2, slot=0),
        Task(1, (0,), (1,), recompute_layers=1, start=1.0, slot=1),
        Task(2, (1,), (2, 3), recompute_layers=1, start=1.0, slot=1)]


@pytest.mark.parametrize("change, message", [
    (lambda t: [replace(t[0], slot=None)] + t[1:], "slot None in a lockstep plan"),
    (lambda t: t[:2] + [replace(t[2], recompute_layers=0)], "recompute as many layers"),
    (lambda t: t[:2] + [replace(t[2], ranks=(0,))], "both in slot 1"),
    (lambda t: [replace(t[0], slot=2)] + t[1:], "slots must rise in execution order"),
    (lambda t: [replace(t[0], slot=-1)] + t[1:], "slot -1"),
])
def test_validate_plan_names_a_broken_slot_rule(change, message):
    validate_plan(_plan(GOOD), check_times=False)
    with pytest.raises(PlanError, match=message):
        validate_plan(_plan(change(list(GOOD))), check_times=False)


def test_plan_json_keeps_slots_and_free_plans_unchanged():
    plan = _plan(GOOD)
    back = Plan.from_json(plan.to_json())
    assert back.lockstep and [t.slot for t in back.tasks] == [0, 1, 1]
    assert back.slot_recompute_layers() == [2, 1] and back.digest() == plan.digest()
    free = _plan([replace(t, slot=None) for t in GOOD])
    assert not free.lockstep and free.slot_recompute_layers() == []
    assert all("slot" not in t for t in json.loads(free.to_json())["tasks"])
    assert free.digest() != plan.digest()


@pytest.mark.parametrize("world,dist,hardware", [(8, "short", "h200"), (32, "long", "a100"),
                                                 (64, "balanced", "h200")])
def test_degree_choice_prunes_only_options_that_cannot_win(world, dist, hardware, monkeypatch):
    # degree_choice passes over wider options whose lower bound of work (least_work: the empty
    # task and the GEMM work, the same at every degree) cannot
    # undercut the work chosen: the choices equal those of timing every option (issue 30)
    from megatron_dcp.plan import choices
    from megatron_dcp.plan.planner import Planner, PlanSettings

    cfg = DCPConfig(hardware=hardware, schedule="lockstep")
    lengths = sample_lengths(dist, world * 262144, seed=3, max_len=262144)
    pctx = Planner(PlanSettings(cfg, LLAMA, world, zero_stage=3)).context(lengths).pctx
    for mode in ("full", "auto"):
        pruned = [choices.SeqChoice(i, pctx.lengths[i], pctx.pairs[i]) for i in pctx.active]
        choices.degree_choice(pctx, pruned, mode)
        with monkeypatch.context() as m:
            m.setattr(choices, "least_work",
                      lambda floors: [choices.WorkFloor(0.0, 0.0, 0.0, 0.0)] * len(floors))
            plain = [choices.SeqChoice(i, pctx.lengths[i], pctx.pairs[i]) for i in pctx.active]
            choices.degree_choice(pctx, plain, mode)
        assert [(c.degree, c.recompute_layers, c.duration) for c in pruned] == \
            [(c.degree, c.recompute_layers, c.duration) for c in plain]
    assert len({c.degree for c in pruned}) > 1
    # raised takes the floor where the sequence fits there, else the first wider size
    for floor in (2, 4, 8, 16):
        for mode in ("auto", "full", "none"):
            for c in pruned:
                first = next(((d, k) for d, k in pctx.fitting_options(c.length, mode)
                              if d >= floor), None)
                got = choices.raised(pctx, choices.SeqChoice(c.i, c.length, c.pairs, 1, 0, 0.0),
                                     mode, floor)
                assert (got.degree, got.recompute_layers) == (first or (1, 0))


@pytest.mark.parametrize("world,dist,moe", [(1024, "balanced", False), (256, "short", False),
                                            (64, "long", False), (64, "long", True)])
def test_slot_index_names_every_slot_that_accepts_an_item(world, dist, moe, monkeypatch):
    # SlotIndex.candidates's contract: at least every slot where `join` would take the item
    # (checked on a copy of the pass's state before each join: the plain scan over all slots);
    # the MoE case packs node-floor items into two-node tasks (a wider group's idle time)
    import copy

    from megatron_dcp.plan import lockstep

    lengths = sample_lengths(dist, 65536 * world, seed=1)
    model = replace(load_model("qwen3-30b-a3b"), expert_parallel=8) if moe else LLAMA
    cfg = DCPConfig(hardware="h200", ranks_per_node=8)
    kw = dict(world_size=world, model=model, zero_stage=2)
    seen = {"items": 0, "skipped": 0}
    first = lockstep.join_first

    def checked(pctx, index, item, mode):
        if seen["items"] < 300:
            seen["items"] += 1
            named = set(index.candidates(item.degree, -float("inf"), 0, 0, 0.0, 0))
            least = min((pctx.seq_time(item.tokens, item.pairs, item.degree, c)
                         for c in index.layers if c >= item.recompute_layers), default=None)
            if least is not None:
                named = set(index.candidates(
                    item.degree, least - pctx.cm.time_model.task_overhead,
                    item.padded(pctx, item.degree), item.tokens, item.pairs,
                    item.recompute_layers))
            for k, slot in enumerate(index.slots):
                if k not in named and slot.recompute_layers >= item.recompute_layers:
                    seen["skipped"] += 1
                    trial = copy.deepcopy((slot, item))
                    assert not lockstep.join(pctx, trial[0], trial[1], mode), (k, item)
        return first(pctx, index, item, mode)

    monkeypatch.setattr(lockstep, "join_first", checked)
    make_plan(lengths, config=cfg, **kw)
    assert seen["items"] > 0
    if world == 1024:
        assert seen["skipped"] > 0  # the index passes over slots


@pytest.mark.parametrize("hardware,curve", [("h200", None), ("a100", None),
                                            ("h200", [[1024, 1.0], [8192, 0.7]])])
def test_work_floors_never_exceed_a_sequences_work(hardware, curve):
    # WorkFloor is a lower bound of ranks x time at any layout: degree_choice skips timing the
    # options whose floor cannot undercut the work chosen, which must never skip a better one
    import random

    from megatron_dcp.plan import load_hardware
    from megatron_dcp.plan.choices import work_floor
    from megatron_dcp.plan.planner import Planner, PlanSettings

    hw = load_hardware(hardware)
    if curve:
        hw = replace(hw, name="curved", pack_curve=curve)
    cfg, moe = DCPConfig(hardware=hardware), load_model("qwen3-30b-a3b")
    for model in (LLAMA, moe):
        pctx = Planner(PlanSettings(cfg, model, 64, zero_stage=3)).context([4096] * 64).pctx
        pctx = replace(pctx, cm=build_cost_model(model, cfg, 64, hardware=hw, zero_stage=3))
        tm, rng = pctx.cm.time_model, random.Random(0)
        for _ in range(400):
            d = rng.choice(pctx.vocab.sizes)
            c = rng.choice((0, model.num_layers // 2, model.num_layers))
            tokens = rng.choice((1, 64, 4096, 65536, 1 << 20))
            pairs = pctx.cm.pairs_of(tokens, None) * rng.choice((0.0, 0.5, 1.0))
            time = tm.best_time(tokens, pairs, d, c)[0]
            assert work_floor(pctx, d, c).of(tokens, pairs) <= d * time


@pytest.mark.parametrize("world,dist", [(256, "short"), (32, "balanced"), (64, "long")])
def test_pruned_passes_could_not_have_won(world, dist):
    # lockstep_candidates(prune=True) skips a recompute-full pass only where least_makespan
    # (a lower bound of every full plan) is above the shortest so far: the same winner
    from megatron_dcp.plan.choices import SeqChoice, degree_choice, least_makespan
    from megatron_dcp.plan.lockstep import lockstep_candidates
    from megatron_dcp.plan.planner import Planner, PlanSettings

    cfg = DCPConfig(hardware="h200", schedule="lockstep")
    lengths = sample_lengths(dist, 65536 * world, seed=2)[:4000]
    pctx = Planner(PlanSettings(cfg, LLAMA, world, zero_stage=3)).context(lengths).pctx
    infos = [SeqChoice(i, pctx.lengths[i], pctx.pairs[i]) for i in pctx.active]
    per_rank, longest = degree_choice(pctx, infos, "auto")
    args = (pctx, infos, "auto", max(per_rank, longest), longest)
    every, pruned = lockstep_candidates(*args), lockstep_candidates(*args, prune=True)
    least = least_makespan(pctx, infos, LLAMA.num_layers)
    assert all(least <= c.makespan for c in every if "recompute=full" in c.name)
    assert min(every, key=lambda c: c.makespan).name == min(pruned, key=lambda c: c.makespan).name
    assert {c.name for c in pruned} <= {c.name for c in every}


def test_narrowed_splits_packed_tasks_over_halves_where_that_shortens_them():
    from megatron_dcp.plan.lockstep_regroup import narrowed
    from megatron_dcp.plan.planner import Planner, PlanSettings

    model = replace(load_model("qwen3-30b-a3b"), expert_parallel=8)
    cfg = DCPConfig(hardware="h200", ranks_per_node=8, policy="dcp")
    lengths = [2000] * 24 + [83000, 3000]
    pctx = Planner(PlanSettings(cfg, model, 64, zero_stage=1)).context(lengths).pctx
    packed = pctx.draft(0, 8, list(range(24)), 0)
    # 83,000 tokens fit no half of a node without recompute: that task stays whole
    whole = pctx.draft(8, 8, [24, 25], 0)
    for d in (packed, whole):
        d.slot = 0
    out = narrowed(pctx, [packed, whole], "auto")
    split = [d for d in out if d.start_rank < 8]
    assert len(split) > 1 and max(d.duration for d in split) < packed.duration
    assert sorted(s for d in split for s in d.seqs) == list(range(24))
    ranks = sorted(r for d in split for r in range(d.start_rank, d.start_rank + d.degree))
    assert len(ranks) == len(set(ranks)) and set(ranks) <= set(range(8))
    assert all(tuple(range(d.start_rank, d.start_rank + d.degree)) in pctx.vocab for d in split)
    assert [(d.start_rank, d.degree, d.seqs) for d in out if d.start_rank >= 8] == \
        [(8, 8, [24, 25])]


def test_merged_spreads_a_slots_longest_task_over_the_ranks_beside_it():
    from megatron_dcp.plan.lockstep_regroup import merged
    from megatron_dcp.plan.planner import Planner, PlanSettings

    model = replace(load_model("qwen3-30b-a3b"), expert_parallel=8)
    cfg = DCPConfig(hardware="h200", ranks_per_node=8, policy="dcp")
    lengths = [83000] + [2000] * 40 + [64000, 60000]
    pctx = Planner(PlanSettings(cfg, model, 64, zero_stage=1)).context(lengths).pctx
    # slot 0: one long sequence alone on a node, memory-full short ones on the next node (they
    # end early), the rest of the ranks free; slot 1: two equal full tasks (nothing to gain)
    slot0 = [pctx.draft(0, 8, [0], 0), pctx.draft(8, 8, list(range(1, 41)), 0)]
    slot1 = [pctx.draft(0, 8, [41], 0), pctx.draft(8, 8, [42], 0)]
    for k, slot in enumerate((slot0, slot1)):
        for d in slot:
            d.slot = k
    assert slot0[1].duration < slot0[0].duration
    out = merged(pctx, slot0 + slot1, "auto")
    for k, before in enumerate((slot0, slot1)):
        after = [d for d in out if d.slot == k]
        assert sorted(s for d in after for s in d.seqs) == sorted(s for d in before for s in d.seqs)
        ranks = [r for d in after for r in range(d.start_rank, d.start_rank + d.degree)]
        assert len(ranks) == len(set(ranks))
        for d in after:
            assert tuple(range(d.start_rank, d.start_rank + d.degree)) in pctx.vocab
            assert pctx.recompute_for(pctx.padded_tokens(d.seqs, d.degree), d.degree,
                                      "auto") == 0
        assert max(d.duration for d in after) <= max(d.duration for d in before)
    # slot 0 got shorter: the long sequence shares a wider group with the short ones
    assert max(d.duration for d in out if d.slot == 0) < slot0[0].duration
    assert any(0 in d.seqs and d.degree > 8 for d in out)
