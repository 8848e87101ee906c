"""The pipeline planner's shortcuts give the answers of the long way: the DCP contest's winner
(`shortest_candidate`, which skips candidates by their lower bound) and the makespan without
the memory walk (`simulate_pipeline(memory=False)`)."""

import random

import pytest

from megatron_dcp.plan.pipeline import Pipeline, SlotCost, simulate_pipeline
from megatron_dcp.plan.pipeline_order import FIXED_ORDERS, best_order, shortest_candidate


def _slots(rng: random.Random, count: int, world: int = 3) -> list[SlotCost]:
    out = []
    for _ in range(count):
        forward = rng.uniform(0.1, 2.0) if rng.random() < 0.8 else rng.uniform(2.0, 8.0)
        out.append(SlotCost(forward, forward * rng.uniform(1.8, 2.2), rng.uniform(0.0, 0.3),
                            [rng.uniform(0, 4) for _ in range(world)],
                            [rng.uniform(0, 1) for _ in range(world)]))
    return out


@pytest.mark.parametrize("stages,virtual", [(2, 1), (4, 1), (4, 2), (3, 3)])
def test_shortest_candidate_is_the_first_least_makespan(stages, virtual):
    pipe, rng = Pipeline(stages, virtual), random.Random(stages * 10 + virtual)
    pad = SlotCost(0.05, 0.1, 0.01, [0.0] * 3, [0.0] * 3)
    for _ in range(25):
        candidates = [_slots(rng, rng.randint(1, 12)) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.3:  # equal candidates: the first one wins
            candidates.insert(rng.randint(0, len(candidates)), list(candidates[0]))
        spans = [best_order(c, pipe, evaluations=FIXED_ORDERS, padding=pad)[1].makespan_s
                 for c in candidates]
        want = min(range(len(candidates)), key=lambda i: spans[i])
        assert shortest_candidate(candidates, pipe, pad) == want


@pytest.mark.parametrize("stages,virtual", [(2, 1), (4, 1), (4, 2)])
def test_makespan_without_memory_is_the_same(stages, virtual):
    pipe, rng = Pipeline(stages, virtual), random.Random(7)
    for count in (1, 3, 9, 17):
        costs = _slots(rng, count)
        full = simulate_pipeline(costs, pipe)
        fast = simulate_pipeline(costs, pipe, memory=False)
        assert (fast.makespan_s, fast.busy_s, fast.bubble_share, fast.micro_batches) == \
            (full.makespan_s, full.busy_s, full.bubble_share, full.micro_batches)
        assert fast.fits and full.peak_bytes and not fast.peak_bytes
