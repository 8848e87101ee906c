"""The group vocabulary's communicators (task groups + sub-groups), its Ulysses scope, and the
planner keeping every layout's sub-groups inside it. Pure Python (no process groups)."""

from __future__ import annotations

import pytest

from megatron_dcp.config import POLICIES, DCPConfig
from megatron_dcp.plan import (PlanError, Task, Vocabulary, build_cost_model, load_model,
                               make_plan, validate_plan)
from megatron_dcp.plan.planners import vocabulary_for_lengths
from megatron_dcp.plan.vocabulary import communicators, ulysses_degrees
from megatron_dcp.plan.workload import sample_lengths


def test_communicators_follow_the_task_layout_convention():
    ranks = tuple(range(10, 18))
    for u in (1, 2, 4, 8):
        task = Task(id=0, ranks=ranks, seqs=(), ulysses=u, ring=8 // u)
        expected = {ranks}
        for g in range(8):
            for sub in (task.ulysses_group(g), task.ring_group(g)):
                if len(sub) > 1:
                    expected.add(tuple(sub))
        assert set(communicators(ranks, u)) == expected
    assert communicators((4, 2, 6, 0), 2) == [(4, 2, 6, 0), (4, 2), (6, 0), (4, 6), (2, 0)]
    assert communicators((5,), 1) == []
    with pytest.raises(ValueError, match="does not divide"):
        communicators((0, 1, 2), 2)


def test_ulysses_degrees_heads_layout_and_scope():
    assert ulysses_degrees(16, 8) == (1, 2, 4, 8, 16)
    assert ulysses_degrees(16, 8, heads=12) == (1, 2, 4)
    # inside a node the scope changes nothing; across nodes: pure ring or Ulysses over the node
    assert ulysses_degrees(8, 8, heads=8, ulysses_scope="node") == (1, 2, 4, 8)
    assert ulysses_degrees(32, 8, heads=32, ulysses_scope="node") == (1, 8)
    assert ulysses_degrees(32, 8, heads=12, ulysses_scope="node") == (1, 4)
    assert ulysses_degrees(12, 8, heads=12, ulysses_scope="node") == (1, 4)
    assert ulysses_degrees(16, 8, heads=8, attention_layout="ring") == (1,)
    assert ulysses_degrees(8, 8, heads=8, attention_layout="ulysses") == (8,)
    assert ulysses_degrees(16, 8, heads=8, attention_layout="ulysses") == (1, 2, 4, 8)
    assert ulysses_degrees(8, 8, heads=8, attention_layout="hybrid") == (1, 2, 4)
    with pytest.raises(ValueError, match="ulysses_scope"):
        ulysses_degrees(8, 8, ulysses_scope="rack")


def test_communicator_counts_by_hand():
    # 4 ranks, one per node, 4 heads: groups (0,1) (2,3) (0,1,2) (0,1,2,3); Ulysses 2 on the
    # whole world adds the ring sub-groups (0,2) (1,3); inside a node (scope "node") it may not
    default = Vocabulary(4, 1, heads=4)
    assert default.communicators() == ((0, 1), (0, 2), (1, 3), (2, 3), (0, 1, 2), (0, 1, 2, 3))
    assert default.communicators_per_rank() == 4
    node = Vocabulary(4, 1, heads=4, ulysses_scope="node")
    assert node.communicators() == ((0, 1), (2, 3), (0, 1, 2), (0, 1, 2, 3))
    assert node.communicators_per_rank() == 3
    assert Vocabulary(1, 8).communicators() == ()
    assert "6 communicators with sub-groups, at most 4 per rank" in default.describe()


def test_communicators_per_rank_at_scale():
    every = Vocabulary(1024, 8)  # every Ulysses degree (no heads given)
    llama = Vocabulary(1024, 8, heads=32)
    node = Vocabulary(1024, 8, heads=32, ulysses_scope="node")
    counts = [v.communicators_per_rank() for v in (every, llama, node)]
    assert counts[0] > counts[1] > counts[2] and counts[2] <= 40, counts
    assert len(node.communicators()) < len(llama.communicators()) < len(every.communicators())
    assert set(node.communicators()) <= set(llama.communicators())


@pytest.mark.parametrize("scope", ["any", "node"])
def test_plans_use_only_vocabulary_communicators(scope):
    model = load_model("llama-7b")
    lengths = sample_lengths("long", 32 * 200_000, seed=3)
    used_outside_node = set()
    for policy in POLICIES:
        # a 49 GB budget (a few GB above the static memory) makes the long sequences need
        # groups spanning nodes, and "ulysses" takes the whole group as Ulysses degree there
        # wherever the heads and the scope allow
        config = DCPConfig(policy=policy, ulysses_scope=scope, attention_layout="ulysses",
                           memory_budget_gb=49)
        vocab = Vocabulary.for_cost_model(build_cost_model(model, config, 32), config.max_degree)
        allowed = set(vocab.communicators())
        for task in make_plan(lengths, world_size=32, model=model, config=config).tasks:
            assert task.ulysses in vocab.ulysses_degrees(task.degree), (policy, task)
            assert set(communicators(task.ranks, task.ulysses)) <= allowed, (policy, task)
            if task.degree > 8 and task.ulysses not in (1, 8):
                used_outside_node.add(policy)
    # the default scope runs Ulysses across nodes; the node scope never does
    assert bool(used_outside_node) == (scope == "any"), used_outside_node


def _h200(world=32, **settings):
    model = load_model("llama-7b")
    config = DCPConfig(hardware="h200", **settings)
    return model, config, build_cost_model(model, config, world)


def test_vocabulary_from_lengths_keeps_the_sizes_the_data_needs():
    model, config, cm = _h200()
    default = Vocabulary.for_cost_model(cm)
    short = sample_lengths("short", 65536 * 32, seed=10, max_len=8192)
    vocab = vocabulary_for_lengths(cm, short)
    # what each length needs: smallest size that fits, least work, least time (+ 1 for packing)
    assert 1 in vocab.sizes and set(vocab.sizes) < set(default.sizes)
    for n in (min(short), max(short)):
        pairs = cm.pairs_of(n)
        fits = [d for d in default.sizes
                if cm.memory_model.min_recompute_layers(cm.padded(n, d), d) == 0]
        assert fits[0] in vocab.sizes
        assert min(fits, key=lambda d: cm.time_model.best_time(n, pairs, d, 0)[0]) in vocab.sizes
    assert vocab.communicators_per_rank() < default.communicators_per_rank()
    assert set(vocab.communicators()) < set(default.communicators())
    assert vocab.rules() == default.rules()
    # a long length brings the smallest size it fits in; no lengths: size 1 alone
    wide = [d for d in default.sizes
            if cm.memory_model.min_recompute_layers(cm.padded(262144, d), d) is not None]
    assert wide[0] not in vocab.sizes and wide[0] in vocabulary_for_lengths(cm, [262144]).sizes
    assert vocabulary_for_lengths(cm, []).sizes == (1,)


def test_plans_over_a_data_vocabulary_are_valid_and_charge_its_communicators():
    model, config, cm = _h200()
    vocab = vocabulary_for_lengths(cm, sample_lengths("short", 65536 * 32, seed=10,
                                                       max_len=8192))
    # the batch's own lengths, and one longer than any the vocabulary was chosen from
    for lengths in (sample_lengths("short", 65536 * 32, seed=0, max_len=8192),
                    [100_000] + [2048] * 200):
        plan = make_plan(lengths, world_size=32, model=model, config=config, vocabulary=vocab)
        validate_plan(plan, model, vocabulary=vocab)
        assert plan.meta["vocabulary_sizes"] == list(vocab.sizes)
        assert plan.meta["communicators_per_rank"] == vocab.communicators_per_rank()
    default = make_plan(lengths, world_size=32, model=model, config=config)
    assert "vocabulary_sizes" not in default.meta
    assert default.meta["communicators_per_rank"] == cm.memory_model.communicators.per_rank
    with pytest.raises(PlanError, match="vocabulary="):
        make_plan(lengths, world_size=32, model=model, config=config.replace(max_degree=8),
                  vocabulary=vocab)


@pytest.mark.parametrize("world,rpn,max_degree,sizes", [
    (1024, 8, None, None), (96, 6, None, None), (40, 8, 16, None), (12, 4, None, (1, 3, 12)),
    (7, 8, None, None)])
def test_starts_ascend(world, rpn, max_degree, sizes):
    # the list scheduler's holes find a group by bisection over Vocabulary.starts
    vocab = Vocabulary(world, rpn, max_degree, sizes=sizes)
    for size in vocab.sizes:
        starts = vocab.first_ranks(size)
        assert list(starts) == sorted(set(starts)) and starts


def test_communicators_are_charged_by_the_collectives_run_on_them():
    """Issue 46 item 10: a communicator's memory follows what runs on it (NCCL connects lazily):
    an all-reduce's channels, and a connection per peer and direction for send/receive (all
    its members for Ulysses' all-to-all, two for the ring)."""
    from megatron_dcp.plan.hardware import NCCL_CONNECTION_BYTES
    from megatron_dcp.plan.vocabulary import (ALL_REDUCE, ALL_TO_ALL, SEND_RECV, Communicators,
                                              operations)

    a2a, ring = frozenset({ALL_TO_ALL}), frozenset({SEND_RECV})
    assert operations((0, 1, 2, 3), 2) == {(0, 1, 2, 3): frozenset(), (0, 1): a2a,
                                           (2, 3): a2a, (0, 2): ring, (1, 3): ring}
    assert operations((0, 1, 2, 3), 2, all_reduce=True)[(0, 1, 2, 3)] == {ALL_REDUCE}
    assert operations((4, 5), 2) == {(4, 5): a2a} and operations((4, 5), 1) == {(4, 5): ring}
    # by hand, 4 ranks, heads 4: rank 0 holds (0,1) a2a+ring: 2 connections, (0,1,2) ring: 2,
    # (0,1,2,3) a2a+ring: 6, (0,2) ring: 2
    vocab = Vocabulary(4, 4, heads=4)
    assert vocab.charge(0.0, 1.0) == Communicators(4, 12.0)
    assert Vocabulary(4, 4, heads=4, task_all_reduce=True).charge(5.0, 1.0).bytes == 12 + 3 * 5
    # a profile with one figure per communicator: charged that, whatever runs
    assert vocab.charge(5.0, None) == Communicators(4, 20.0)
    # Ulysses over 8 H100s: NCCL issue #1685's 3.28 GB, where the old charge said 0.5 GB
    from megatron_dcp.plan import load_hardware

    h100 = load_hardware("h100")
    only8 = Vocabulary(8, 8, heads=8, attention_layout="ulysses", sizes=(8,))
    assert only8.operations() == {tuple(range(8)): a2a}
    got = only8.charge(h100.communicator_bytes, h100.connection_bytes).bytes
    assert got == pytest.approx(3.28e9) == 14 * NCCL_CONNECTION_BYTES
    # MoE models all-reduce over their task groups: the cost model's vocabulary says so
    roomy = DCPConfig(memory_budget_gb=1e4)
    moe = build_cost_model(load_model("mixtral-8x7b"), roomy, 8)
    assert Vocabulary.for_cost_model(moe).task_all_reduce
    dense = build_cost_model(load_model("llama-7b"), roomy, 8)
    assert not Vocabulary.for_cost_model(dense).task_all_reduce
    assert moe.memory_model.communicators.bytes > dense.memory_model.communicators.bytes


def test_a_communicator_across_nodes_gives_every_peer_the_network_channels():
    """Issue 55: NCCL gives every peer of a communicator the least channel count over its peers
    (``ncclTopoComputeP2pChannels``), so an all-to-all group of two 8-GPU nodes sets up 2
    channels to each of its 15 peers, the 7 on its own node too; before, those 7 were charged
    32 channels each (7 of the 7.5 connections charged), ~3 GB a rank over-charged."""
    from megatron_dcp.plan.vocabulary import (ALL_TO_ALL, NET_CONNECTION_SHARE, SEND_RECV,
                                              member_connections)

    both_nodes = tuple(range(16))
    got = dict(member_connections(both_nodes, {ALL_TO_ALL}, 8))
    assert got == {r: pytest.approx(30 * NET_CONNECTION_SHARE) for r in both_nodes}
    assert dict(member_connections(tuple(range(8)), {ALL_TO_ALL}, 8)) == {r: 14.0
                                                                         for r in range(8)}
    # a ring across nodes: every member's two connections at the network's channels, also
    # the members whose neighbours share their node
    ring = dict(member_connections((0, 1, 8, 9), {SEND_RECV}, 8))
    assert ring == {r: pytest.approx(2 * NET_CONNECTION_SHARE) for r in (0, 1, 8, 9)}
    assert dict(member_connections((0, 1), {SEND_RECV}, 8)) == {0: 2.0, 1: 2.0}
