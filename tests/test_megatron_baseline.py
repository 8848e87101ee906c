"""Megatron's real BalancedCPScheduler (hybrid/dynamic CP) converted to a baseline Plan."""

import math

import pytest

from megatron_dcp.config import DCPConfig
from megatron_dcp.megatron.hybrid_cp_baseline import hybrid_cp_plan, megatron_groups
from megatron_dcp.plan import ModelShape, build_cost_model, validate_plan

LENGTHS = [4000, 300, 900, 1500, 2100, 120, 7000, 650, 80, 3000, 5000, 40]
MODEL = ModelShape(num_layers=4, hidden_size=256, num_heads=8, ffn_hidden_size=1024,
                   vocab_size=1000, num_kv_heads=4)


def test_every_sequence_once_with_megatron_cp_sizes():
    plan = hybrid_cp_plan(LENGTHS, world_size=8, max_seqlen_per_rank=2048)
    validate_plan(plan, MODEL, check_times=False)
    for task in plan.tasks:
        n = plan.lengths[task.seqs[0]]
        # Megatron: CP = next power of two of length / max per rank (it may widen to fill ranks)
        assert task.degree >= 2 ** max(0, math.ceil(math.log2(n / 2048)))
        assert task.degree & (task.degree - 1) == 0
        assert task.ring == task.degree and list(task.ranks) == sorted(task.ranks)
    assert plan.policy == "megatron-hybrid-cp" and plan.meta["groups"] >= 1


def test_timed_with_the_cost_model_and_groups_separated_by_barriers():
    cm = build_cost_model(MODEL, DCPConfig(), world_size=8)
    plan = hybrid_cp_plan(LENGTHS, world_size=8, max_seqlen_per_rank=2048, cost_model=cm)
    validate_plan(plan, MODEL, check_times=True)
    groups = megatron_groups(LENGTHS, 8, 2048)
    first_of_group = {}
    for g, per_rank in enumerate(groups):
        for ids in per_rank:
            for s in ids:
                first_of_group.setdefault(s, g)
    by_group = {}
    for t in plan.tasks:
        by_group.setdefault(first_of_group[t.seqs[0]], []).append(t)
    for g in range(1, len(groups)):
        assert min(t.start for t in by_group[g]) >= max(t.end for t in by_group[g - 1]) - 1e-12


def test_too_long_for_the_domain_is_a_clear_error():
    with pytest.raises(ValueError, match="needs more than the 2 ranks"):
        megatron_groups([5000], world_size=2, max_seqlen_per_rank=1024)
