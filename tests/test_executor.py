"""Exactness of `run_plan` on gloo: loss and every reduced gradient equal a single-process run.

Each launch runs many hand-built plans (one process group per launch, cases batched to keep
start-up cost down). Plans mix degrees, layouts (Ulysses, ring, hybrid), checkpoint depths,
uneven numbers of tasks per rank and ranks with no task.
"""

from __future__ import annotations

import pytest

from distributed import run_distributed
from executor_cases import (assert_matches, build_model, plan_dict, reference,
                            run_cases, task)


LENGTHS_A = (9, 17, 5, 30, 12, 2, 23)


def _degree1_cases(world: int) -> list[dict]:
    """Plans of single-rank tasks: uneven task counts, a rank without work, 0 to 3
    recomputed layers."""
    L = LENGTHS_A
    cases = []
    # All sequences on rank 0 in 3 packed tasks; other ranks idle.
    cases.append(dict(name="all-on-rank0", model="decoder", plan=plan_dict(
        [task(0, [0], [0, 1], recompute_layers=0), task(1, [0], [2, 3, 4], recompute_layers=3),
         task(2, [0], [5, 6], recompute_layers=1)],
        L, world)))
    # Round-robin, ranks get different numbers of tasks, the last rank none (world > 1).
    busy = max(1, world - 1)
    tasks = [task(i, [i % busy], [i], recompute_layers=i % 4, start=0.1 * i) for i in range(len(L))]
    cases.append(dict(name="round-robin", model="decoder", plan=plan_dict(tasks, L, world)))
    cases.append(dict(name="tied-seq-mean", model="decoder-tied", loss_reduction="sequence",
                      plan=plan_dict(tasks, L, world)))
    return cases


def _check(world: int, cases: list[dict]) -> list[dict]:
    results = run_distributed(run_cases, world, args=(cases,))
    for case in cases:
        ref = reference(case["model"], case["plan"]["lengths"],
                        loss_reduction=case.get("loss_reduction", "token"))
        assert_matches(case["name"], results, ref)
    return results


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])
def test_degree1_plans_match_reference(world):
    results = _check(world, _degree1_cases(world))
    # Checkpoint control: a task with recompute_layers=c recomputes layers < c (two calls each).
    calls = results[0]["all-on-rank0"]["calls"]
    assert calls == {0: 3 + 2, 1: 3 + 1, 2: 3 + 1}, calls


# The video DiT (latent videos of mixed shapes, every token its own target) has its own
# exactness tests: tests/test_video.py.
LENGTHS_P = (60, 9, 17, 5, 30, 12, 2, 23, 44, 3, 8, 51)


def _planned(kind: str, lengths, world: int, policy: str = "dcp", free_tokens: int = 12) -> dict:
    """A plan from `make_plan` with a memory budget of ``free_tokens`` activation tokens per rank
    beyond static memory, so long sequences need degree > 1 and recomputation."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import CostModel, load_hardware, make_plan

    shape = build_model(kind).shape()
    hw = load_hardware("h200")
    base = CostModel(shape, hw, world_size=world)
    # static, reserve, activations, loss workspace
    budget = base.memory_model.memory_of(free_tokens, 1, 0)
    cm = CostModel(shape, hw, world_size=world, memory_budget=budget)
    plan = make_plan(list(lengths), world_size=world, model=shape,
                     config=DCPConfig(policy=policy), cost_model=cm)
    return dict(name=f"w{world}-{kind}-{policy}-planned", model=kind, plan=plan.to_dict())


def _world2_cases() -> list[dict]:
    L = LENGTHS_A
    mixed = [task(0, [0, 1], [3, 6], ulysses=2, recompute_layers=0, start=0.0),
             task(1, [0], [0, 2], recompute_layers=1, start=1.0),
             task(2, [1], [4, 5], recompute_layers=2, start=1.0),
             # ring 2, reversed rank order
             task(3, [1, 0], [1], ulysses=1, recompute_layers=3, start=2.0)]
    # Tasks whose only sequence has one token (no target; both ranks hold only padding rows
    # but one) at ring 2 and Ulysses 2, under the per-sequence mean that must skip them.
    single = [task(0, [0, 1], [1], ulysses=1),
              task(1, [1, 0], [3], ulysses=2, recompute_layers=1),
              task(2, [0], [0], start=1.0), task(3, [1], [2], start=1.0)]
    return [_planned("decoder", LENGTHS_P, 2, free_tokens=20),
            dict(name="w2-single-token", model="decoder", loss_reduction="sequence",
                 plan=plan_dict(single, (9, 1, 17, 1), 2)),
            dict(name="w2-mixed", model="decoder", plan=plan_dict(mixed, L, 2)),
            dict(name="w2-mixed-seq", model="decoder", loss_reduction="sequence",
                 plan=plan_dict(mixed, L, 2))]


def _world4_cases() -> list[dict]:
    L = LENGTHS_A
    mixed = [task(0, [0, 1, 2, 3], [3], ulysses=2, recompute_layers=2, start=0.0),  # hybrid 2 x 2
             task(1, [1, 2, 3], [6, 0], ulysses=1, recompute_layers=1, start=1.0),  # ring 3
             task(2, [0], [1], recompute_layers=3, start=1.0),
             task(3, [3, 0], [4], ulysses=2, recompute_layers=0, start=2.0),        # Ulysses 2
             task(4, [0], [2, 5], recompute_layers=0, start=3.0)]
    idle = [task(0, [0, 1, 2, 3], [3, 1], ulysses=1, recompute_layers=3, start=0.0),  # ring 4
            task(1, [2, 1], [6], ulysses=1, recompute_layers=1, start=1.0),          # ring 2
            task(2, [0], [0, 2, 4, 5], recompute_layers=2, start=1.0)]  # rank 3: one task
    no_task = [task(0, [0, 1, 2], [3, 6], ulysses=1, recompute_layers=0),  # rank 3 idle
               task(1, [0, 2], [0, 1, 2, 4, 5], ulysses=2, recompute_layers=3, start=1.0)]
    return [_planned("decoder", LENGTHS_P, 4),
            _planned("decoder", LENGTHS_P, 4, policy="greedy-cp"),
            dict(name="w4-mixed", model="decoder", plan=plan_dict(mixed, L, 4)),
            dict(name="w4-ring", model="decoder-tied", plan=plan_dict(idle, L, 4)),
            dict(name="w4-idle-rank", model="decoder", plan=plan_dict(no_task, L, 4))]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_world2_mixed_layouts_match_reference():
    _check(2, _world2_cases())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_world4_mixed_degrees_match_reference():
    results = _check(4, _world4_cases())
    assert results[3]["w4-idle-rank"]["ntasks"] == 0
    assert results[0]["_pool"]["groups"] >= 6


def test_target_weights_token_and_sequence():
    from megatron_dcp.runtime.targets import target_weights

    # 3 sequences with 4, 0 and 2 targets: T = 6 targets, S = 2 sequences that have one
    assert target_weights([5, 1, 3]) == [1 / 6] * 3
    assert target_weights([5, 1, 3], "sequence") == [1 / (2 * 4), 0.0, 1 / (2 * 2)]
    assert target_weights([1, 1], "token") == [0.0, 0.0]  # no target at all: nothing to learn
    with pytest.raises(ValueError, match="loss_reduction='mean'"):
        target_weights([3], "mean")
