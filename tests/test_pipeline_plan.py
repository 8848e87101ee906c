"""Pipelines in the planner (megatron_dcp/plan/pipeline.py): the event simulator against
hand-computed 1F1B and interleaved makespans, the in-flight memory per stage, a plan that only
fits in the right slot order, the lower bound below every simulated order, and make_plan with
P > 1 (lockstep slots that fit the in-flight memory)."""

import itertools
from dataclasses import replace

import pytest

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan import PlanError, build_cost_model, load_model, make_plan, simulate
from megatron_dcp.plan.pipeline import (Op, Pipeline, SlotCost, device_ops,
                                        interleaved_micro_batches, padding_cost, simulate_pipeline,
                                        slot_costs)
from megatron_dcp.plan.pipeline_order import best_order, pipeline_lower_bound


def slot(forward, backward, p2p=0.0, kept=1.0, running=0.0):
    return SlotCost(forward, backward, p2p, [kept], [running])


@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (2, 5), (4, 4), (4, 8)])
def test_equal_micro_batches_1f1b(stages, micro_batches):
    # equal micro-batches: (M + P - 1) x (F + B), the textbook 1F1B makespan
    result = simulate_pipeline([slot(1.0, 2.0)] * micro_batches, Pipeline(stages))
    assert result.makespan_s == pytest.approx((micro_batches + stages - 1) * 3.0)
    assert result.bubble_share == pytest.approx((stages - 1) / (micro_batches + stages - 1))


def test_unequal_micro_batches_by_hand():
    # P = 2, micro-batches (F, B) = (1, 2), (3, 6), hop 0.5. Stage 0: F0, F1, B0, B1; stage 1:
    # F0, B0, F1, B1. s0 F0 [0,1]; s0 F1 [1,4]; s1 F0 [1.5,2.5]; s1 B0 [2.5,4.5];
    # s1 F1 [4.5,7.5] (input at 4.5); s0 B0 [5,7] (gradient at 5); s1 B1 [7.5,13.5];
    # s0 B1 [14,20]
    result = simulate_pipeline([slot(1, 2, 0.5), slot(3, 6, 0.5)], Pipeline(2))
    assert result.makespan_s == pytest.approx(20.0)
    s0 = [(run.op.forward, run.op.micro_batch, run.start, run.end) for run in result.ops[0]]
    assert s0 == [(True, 0, 0, 1), (True, 1, 1, 4), (False, 0, 5, 7), (False, 1, 14, 20)]
    # P = 4, (1, 2) then (2, 4), no hop: every stage runs F0 F1 B0 B1 (stage 3: F0 B0 F1 B1).
    # Forwards: F1 ends at 3, 5, 7 on stages 0-2, 9 on stage 3; stage 3: B0 [4,6], B1 [9,13];
    # stage 2: B0 [7,9] (busy with F1 until 7), B1 [13,17]; stage 1: B0 [9,11], B1 [17,21];
    # stage 0: B0 [11,13], B1 [21,25]
    result = simulate_pipeline([slot(1, 2), slot(2, 4)], Pipeline(4))
    assert result.makespan_s == pytest.approx(25.0)
    # one micro-batch with hops: 4 forwards, 4 backwards and 6 hops in a row
    assert simulate_pipeline([slot(1, 2, 0.25)], Pipeline(4)).makespan_s == pytest.approx(13.5)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (4, 4)])
def test_interleaved_equal_micro_batches(stages, micro_batches):
    # V = 2 with M a multiple of P: the bubble shrinks by V: (M + (P - 1) / V) x (F + B)
    result = simulate_pipeline([slot(1.0, 2.0)] * micro_batches, Pipeline(stages, 2))
    assert result.makespan_s == pytest.approx((micro_batches + (stages - 1) / 2) * 3.0)


def test_op_order_is_megatrons():
    assert device_ops(Pipeline(4), 1, 4) == [Op(True, 0, 0), Op(True, 1, 0), Op(True, 2, 0),
                                             Op(False, 0, 0), Op(True, 3, 0), Op(False, 1, 0),
                                             Op(False, 2, 0), Op(False, 3, 0)]
    ops = device_ops(Pipeline(2, 2), 0, 4)
    # warm-up (P - 1) * 2 + (V - 1) * P = 4 chunk forwards in Megatron's table order
    assert ops[:4] == [Op(True, 0, 0), Op(True, 1, 0), Op(True, 0, 1), Op(True, 1, 1)]
    assert ops[5] == Op(False, 0, 1)  # the first backward runs the last chunk


@pytest.mark.parametrize("stages,virtual", [(2, 1), (4, 1), (4, 2)])
def test_in_flight_count_per_stage(stages, virtual):
    result = simulate_pipeline([slot(1, 2)] * 8, Pipeline(stages, virtual))
    pipe = Pipeline(stages, virtual)
    assert result.held == [pipe.held(s) for s in range(stages)]
    if virtual == 1:
        assert result.held == [stages - s for s in range(stages)]  # 1F1B: P - s
    else:
        assert result.held[0] == ((stages - 1) * 2 + (virtual - 1) * stages + 1) / virtual


def test_peak_memory_counts_the_window():
    # P = 2: stage 0 holds two consecutive micro-batches, plus the running one's extra bytes
    costs = [slot(1, 2, kept=k, running=0.5) for k in (1.0, 4.0, 2.0, 8.0)]
    result = simulate_pipeline(costs, Pipeline(2))
    assert result.peak_bytes == [pytest.approx(2.0 + 8.0 + 0.5), pytest.approx(8.0 + 0.5)]


@pytest.mark.parametrize("virtual", [1, 2])
def test_the_logits_count_on_the_last_stage_only(virtual):
    """The logits, loss and model ends (`SlotCost.head`) run on the last stage's last chunk:
    the other stages' peaks leave them out (issue 55: every stage was charged them)."""
    costs = [SlotCost(1, 2, 0.0, [4.0], [0.5], [100.0]) for _ in range(4)]
    result = simulate_pipeline(costs, Pipeline(2, virtual))
    without = simulate_pipeline([SlotCost(1, 2, 0.0, [4.0], [0.5]) for _ in range(4)],
                                Pipeline(2, virtual))
    assert result.peak_bytes[0] == pytest.approx(without.peak_bytes[0])
    assert result.peak_bytes[1] == pytest.approx(without.peak_bytes[1] + 100.0)


def test_plan_fits_only_in_the_right_order():
    cm = _cost_model(pipeline_parallel=2)
    free = cm.memory_model.budget - cm.memory_model.static_memory - cm.memory_model.reserve
    big, small = 0.6 * free, 0.3 * free
    costs = [SlotCost(1, 2, 0.0, [big], [0.0]), SlotCost(1, 2, 0.0, [big], [0.0]),
             SlotCost(1, 2, 0.0, [small], [0.0]), SlotCost(1, 2, 0.0, [small], [0.0])]
    pipe = Pipeline(2)
    assert not simulate_pipeline(costs, pipe, cm).fits  # big, big side by side
    order, result = best_order(costs, pipe, cm)
    assert result.fits and simulate_pipeline(costs, pipe, cm, order).fits
    assert all(sorted(order[i:i + 2]) != [0, 1] for i in range(3))
    with pytest.raises(PlanError, match="fits the in-flight memory"):
        best_order([SlotCost(1, 2, 0.0, [big], [0.0])] * 3, pipe, cm)


@pytest.mark.parametrize("stages,virtual", [(2, 1), (4, 1), (4, 2)])
def test_lower_bound_below_every_order(stages, virtual):
    costs = [slot(1, 2, 0.1), slot(3, 6, 0.2), slot(0.5, 1, 0.1), slot(2, 4, 0.1),
             slot(0.2, 0.5, 0.1)]
    pipe = Pipeline(stages, virtual)
    work = sum(c.time for c in costs) * 0.9  # any valid work bound below the slots' own work
    bound = pipeline_lower_bound(work, costs, pipe)
    spans = [simulate_pipeline(costs, pipe, order=list(o)).makespan_s
             for o in itertools.permutations(range(len(costs)))]
    assert bound <= min(spans) + 1e-9
    assert bound > work  # the bubble counts
    order, result = best_order(costs, pipe)
    assert result.makespan_s == pytest.approx(min(spans), rel=0.05)


def _cost_model(**pipeline):
    model = replace(load_model("llama-70b"), tensor_parallel=8, **pipeline)
    return build_cost_model(model, DCPConfig(hardware="h200"), 8, zero_stage=1)


@pytest.mark.parametrize("policy", ["dcp", "greedy-cp", "static"])
def test_make_plan_with_pipeline(policy):
    model = replace(load_model("llama-70b"), tensor_parallel=8, pipeline_parallel=4)
    cm = _cost_model(pipeline_parallel=4)
    assert cm.model.num_layers == 20  # one stage
    lengths = [100_000, 60_000, 30_000] + [2_000 + 37 * i for i in range(80)]
    plan = make_plan(lengths, world_size=8, model=model, config=DCPConfig(policy=policy,
                                                                         hardware="h200"),
                     cost_model=cm)
    assert plan.lockstep and plan.meta["pipeline"]["fits"]
    again = make_plan(lengths, world_size=8, model=model,
                      config=DCPConfig(policy=policy, hardware="h200"), cost_model=cm)
    assert again.digest() == plan.digest()
    r = simulate(plan, cm, pipeline=Pipeline.of(model))
    assert r.memory_fits and r.micro_batches == len(slot_costs(plan, cm))
    assert r.lower_bound_s <= r.step_time_s and 0 < r.bubble_share < 1
    # slots are micro-batches: the plain sum of slots is below the pipelined makespan
    assert simulate(plan, cm).makespan_s < r.makespan_s


def test_pipeline_fields_checked():
    base = load_model("llama-70b")
    with pytest.raises(ValueError, match="divisible"):
        replace(base, pipeline_parallel=3)
    with pytest.raises(ValueError, match="needs pipeline_parallel"):
        replace(base, virtual_pipeline=2)
    assert replace(base, pipeline_parallel=4, virtual_pipeline=2).layers_per_stage == 20


@pytest.mark.parametrize("seed", range(4))
def test_stage0_idle_bound_below_every_order(seed):
    # 1F1B: few large micro-batches among small ones, where stage 0's idle while the large ones
    # travel dominates; the bound (pairs of windows P apart) stays below every order's makespan
    import random
    rng = random.Random(seed)
    times = [rng.choice([0.6, 0.7, 0.8, 0.9]) for _ in range(4)] + \
        [rng.uniform(0.01, 0.25) for _ in range(3)]
    costs = [slot(t / 3, 2 * t / 3, 0.004) for t in times]
    pipe = Pipeline(4)
    bound = pipeline_lower_bound(0.0, costs, pipe)
    best = min(simulate_pipeline(costs, pipe, order=list(o)).makespan_s
               for o in itertools.permutations(range(len(costs))))
    assert bound <= best + 1e-9
    assert bound >= 0.8 * best and bound > sum(times)  # the idle of stage 0 counts


def _megatron_accepts(m, stages, group=None, virtual=2):
    # megatron-core 0.16.1's interleaved schedule: group <= M, and the last group whole or >= PP;
    # and stage 0 not all warm-up (the stages' shape exchanges would meet in different orders)
    group = group or stages
    warmup = 2 * (stages - 1) + (virtual - 1) * group
    return group <= m and not 0 < m % group < stages and m * virtual > warmup


def test_interleaved_runs_a_count_megatron_accepts():
    for stages in (2, 4):
        for count in range(1, 12):
            m = Pipeline(stages, 2).micro_batches(count)
            assert _megatron_accepts(m, stages) and m >= count
            assert not any(_megatron_accepts(n, stages) for n in range(count, m))
            assert Pipeline(stages).micro_batches(count) == count  # 1F1B: no padding
    assert interleaved_micro_batches(10, 4, group=6) == 10  # 6 + 4: a last group of PP
    # 3 slots at P = 2, V = 2: the schedule runs 4 micro-batches, the padding last (as the
    # runtime appends it), in time and in memory
    costs = [slot(1, 2, 0.1, kept=2.0), slot(3, 6, 0.1, kept=5.0), slot(1, 2, 0.1, kept=2.0)]
    pad = SlotCost(0.25, 0.5, 0.01, [1.0], [0.0])
    pipe = Pipeline(2, 2)
    result = simulate_pipeline(costs, pipe, padding=pad)
    assert result.micro_batches == 4
    assert {run.op.micro_batch for run in result.ops[0]} == {0, 1, 2, 3}
    explicit = simulate_pipeline(costs + [pad], pipe)
    assert result.makespan_s == pytest.approx(explicit.makespan_s)
    assert result.peak_bytes == pytest.approx(explicit.peak_bytes)
    assert result.makespan_s > simulate_pipeline(costs, pipe, padding=slot(0, 0, 0, 0)).makespan_s
    bound = pipeline_lower_bound(0.0, costs, pipe, pad)
    assert bound <= min(simulate_pipeline(costs, pipe, order=list(o), padding=pad).makespan_s
                        for o in itertools.permutations(range(3))) + 1e-9


def test_runtime_pads_with_the_planners_rule():
    engine = pytest.importorskip("megatron_dcp.megatron.pipeline_engine")
    assert engine.interleaved_micro_batches is interleaved_micro_batches


def test_make_plan_with_virtual_stages_plans_the_padded_count():
    model = replace(load_model("llama-70b"), tensor_parallel=8, pipeline_parallel=4,
                    virtual_pipeline=2)
    cm = _cost_model(pipeline_parallel=4, virtual_pipeline=2)
    lengths = [60_000, 30_000] + [2_000 + 37 * i for i in range(40)]
    plan = make_plan(lengths, world_size=8, model=model,
                     config=DCPConfig(policy="dcp", hardware="h200"), cost_model=cm)
    meta = plan.meta["pipeline"]
    slots = len(slot_costs(plan, cm))
    assert meta["micro_batches"] == interleaved_micro_batches(slots, 4) and meta["fits"]
    r = simulate(plan, cm, pipeline=Pipeline.of(model))
    assert r.micro_batches == meta["micro_batches"]
    assert r.makespan_s == pytest.approx(meta["makespan_s"])
    assert r.lower_bound_s <= r.step_time_s
    pad = padding_cost(cm, 8)
    assert 0 < pad.time <= min(c.time for c in slot_costs(plan, cm))


def test_sequence_parallel_sends_a_tp_share_between_stages():
    plain, sp = _cost_model(pipeline_parallel=4), _cost_model(pipeline_parallel=4,
                                                              sequence_parallel=True)
    model = replace(load_model("llama-70b"), tensor_parallel=8, pipeline_parallel=4)
    plan = make_plan([40_000, 8_000, 8_000], world_size=8, model=model,
                     config=DCPConfig(policy="static", hardware="h200"), cost_model=plain)
    latency = plain.hw.inter_latency
    for a, b in zip(slot_costs(plan, plain), slot_costs(plan, sp)):
        assert b.p2p - latency == pytest.approx((a.p2p - latency) / 8, rel=1e-3)


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_stage0_idle_bound_below_every_order(seed):
    # V = 2, P = 2: one micro-batch much longer than the others; stage 0 idles while its last
    # chunk travels, which the interleaved window bound counts (7 slots, padded to 8)
    import random
    rng = random.Random(seed)
    times = [rng.uniform(0.9, 1.1)] + [rng.uniform(0.1, 0.3) for _ in range(6)]
    costs = [slot(t / 3, 2 * t / 3, 0.004) for t in times]
    pipe = Pipeline(2, 2)
    bound = pipeline_lower_bound(0.0, costs, pipe)
    best = min(simulate_pipeline(costs, pipe, order=list(o)).makespan_s
               for o in itertools.permutations(range(len(costs))))
    assert bound <= best + 1e-9
    longest_through = 2 * max(times) + 2 * 0.004  # the bound's other terms
    assert bound > max(longest_through, sum(times)) + 0.1
