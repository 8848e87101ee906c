"""Exactness of `run_plan` on gloo: loss and every reduced gradient equal a single-process run.

Each launch runs many hand-built plans (one process group per launch, cases batched to keep
start-up cost down). Plans mix degrees, layouts (Ulysses, ring, hybrid), checkpoint depths,
uneven numbers of tasks per rank and ranks with no task.
"""

from __future__ import annotations

import pytest

from distributed import run_distributed
from executor_cases import (ATTENTION_STAND_IN, assert_matches, plan_dict, reference, run_cases,
                            task)

needs_attention = pytest.mark.skipif(ATTENTION_STAND_IN,
                                     reason="megatron_dcp.runtime.attention has not landed")

LENGTHS_A = (9, 17, 5, 30, 12, 2, 23)


def _degree1_cases(world: int) -> list[dict]:
    """Plans of single-rank tasks: uneven task counts, a rank without work, every ckpt depth."""
    L = LENGTHS_A
    cases = []
    # All sequences on rank 0 in 3 packed tasks; other ranks idle.
    cases.append(dict(name="all-on-rank0", model="decoder", plan=plan_dict(
        [task(0, [0], [0, 1], ckpt=0), task(1, [0], [2, 3, 4], ckpt=3), task(2, [0], [5, 6], ckpt=1)],
        L, world)))
    # Round-robin, ranks get different numbers of tasks, the last rank none (world > 1).
    busy = max(1, world - 1)
    tasks = [task(i, [i % busy], [s], ckpt=i % 4, start=0.1 * i) for i, s in enumerate(range(len(L)))]
    cases.append(dict(name="round-robin", model="decoder", plan=plan_dict(tasks, L, world)))
    cases.append(dict(name="tied-seq-mean", model="decoder-tied", loss_reduction="sequence",
                      plan=plan_dict(tasks, L, world)))
    return cases


def _check(world: int, cases: list[dict]) -> list[dict]:
    results = run_distributed(run_cases, world, args=(cases,))
    for case in cases:
        ref = reference(case["model"], LENGTHS_A, loss_reduction=case.get("loss_reduction", "token"))
        assert_matches(case["name"], results, ref)
    return results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])
def test_degree1_plans_match_reference(world):
    results = _check(world, _degree1_cases(world))
    # Checkpoint control: a task with ckpt_layers=c recomputes layers < c (two calls each).
    calls = results[0]["all-on-rank0"]["calls"]
    assert calls == {0: 3 + 2, 1: 3 + 1, 2: 3 + 1}, calls
