"""`GroupPool` on gloo: collective creation, caching, lookup, task contexts, sub-worlds."""

from __future__ import annotations

import pytest

from distributed import run_distributed

pytestmark = pytest.mark.slow  # every test here launches processes


def _pool_body(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_dcp.plan.plan import Plan, Task
    from megatron_dcp.runtime.groups import GroupPool, groups_of_plan

    pool = GroupPool()
    out: dict = {}
    hybrid = Task(id=0, ranks=(3, 1, 2, 0), seqs=(0,), ulysses=2, ring=2)
    ring3 = Task(id=1, ranks=(0, 1, 2), seqs=(1,), ulysses=1, ring=3)
    plan = Plan(tasks=(hybrid, ring3), lengths=(8, 8), world_size=4)
    out["needed"] = groups_of_plan(plan)
    out["created"] = pool.ensure(plan)
    out["again"] = pool.ensure(plan)
    # Group order is the task's rank order: group rank of DCP rank r in (3, 1, 2, 0).
    grp = pool.get((3, 1, 2, 0))
    out["group_rank"] = dist.get_rank(grp)
    # A collective on a sub-group in task order: all-gather of the DCP ranks.
    parts = [torch.zeros(1) for _ in range(4)]
    dist.all_gather(parts, torch.tensor([float(rank)]), group=grp)
    out["gathered"] = [int(p.item()) for p in parts]
    ctx = pool.context_for(hybrid, rank, layout=None)
    out["ctx"] = (ctx.group_rank, ctx.ulysses_group is not None, ctx.ring_group is not None)
    try:
        pool.get((0, 3))
        out["missing"] = ""
    except KeyError as exc:
        out["missing"] = str(exc)
    from megatron_dcp.plan import Vocabulary

    # two nodes of two ranks, Ulysses degree 1 or 2: (0,1) (2,3) (0,1,2,3), ring (0,2) (1,3)
    vocab = Vocabulary(4, 2, heads=2)
    pool.create_all(vocab)
    out["vocab_created"] = pool.startup["created"]
    out["report"] = pool.report()
    out["vocab_all"] = all(g in pool for g in vocab.communicators())
    # Two DCP worlds (like tensor parallelism 2): (0, 2) and (1, 3), running the same plan (as
    # tensor parallelism needs); its ring group is created in both worlds together.
    sub = GroupPool(all_worlds=[(0, 2), (1, 3)])
    tasks = (Task(id=0, ranks=(1, 0), seqs=(0,), ulysses=1, ring=2),)
    sub_plan = Plan(tasks=tasks, lengths=(8,), world_size=2)
    out["sub_created"] = sub.ensure(sub_plan)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=sub.get((1, 0)))
    out["sub_sum"] = float(t)
    out["sub_rank"] = (sub.rank, dist.get_rank(sub.get((1, 0))))
    sub.create_all(Vocabulary(2, 2))  # its one communicator is the world's: warmed, not created
    out["sub_startup"] = sub.startup
    # The same worlds given as this rank's world only (the pool gathers the others).
    sub2 = GroupPool(world_ranks=(0, 2) if rank in (0, 2) else (1, 3))
    sub2.ensure(sub_plan)
    out["sub2_worlds"] = sub2.all_worlds
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_group_pool_world4():
    results = run_distributed(_pool_body, 4, timeout_s=100)
    r0 = results[0]
    # hybrid (3,1,2,0) u2 x r2: task group, Ulysses (3,1),(2,0), ring (3,2),(1,0); ring3 (0,1,2)
    assert r0["needed"] == [(1, 0), (2, 0), (3, 1), (3, 2), (0, 1, 2), (3, 1, 2, 0)]
    assert r0["created"] == 6 and r0["again"] == 0
    for rank, res in enumerate(results):
        assert res["group_rank"] == (3, 1, 2, 0).index(rank)
        assert res["gathered"] == [3, 1, 2, 0]
        assert res["ctx"] == ((3, 1, 2, 0).index(rank), True, True)
        assert "no process group for ranks (0, 3)" in res["missing"]
    # vocabulary: (0,1), (2,3), (0,1,2,3) (= the world group, reused) and the ring sub-groups of
    # (0,1,2,3) at u=2: (0,2), (1,3) -> 4 new groups
    assert r0["vocab_created"] == 4
    assert r0["report"]["groups"] == 1 + 6 + 4
    assert all(res["vocab_all"] for res in results)
    assert [res["sub_sum"] for res in results] == [2.0, 4.0, 2.0, 4.0]
    assert [res["sub_created"] for res in results] == [1, 1, 1, 1]
    assert all(res["sub2_worlds"] == [(0, 2), (1, 3)] for res in results)
    assert [res["sub_rank"] for res in results] == [(0, 1), (0, 1), (1, 0), (1, 0)]
    assert all(res["sub_startup"]["communicators"] == 1 and res["sub_startup"]["created"] == 0
               and res["sub_startup"]["member_of"] == 1 for res in results)


def _startup_body(rank: int, world_size: int) -> dict:
    import warnings

    import torch
    import torch.distributed as dist

    from megatron_dcp.config import POLICIES, DCPConfig
    from megatron_dcp.plan import ModelShape, Plan, Task, Vocabulary, build_cost_model, make_plan
    from megatron_dcp.runtime.groups import GroupPool

    # one rank per node: the "node" scope allows no Ulysses across ranks at all
    model = ModelShape(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=128,
                       vocab_size=256, name="tiny")
    cm = build_cost_model(model, DCPConfig(ranks_per_node=1), world_size)  # the most groups
    # memory for about 3,000 local tokens: long sequences need several ranks
    budget = (cm.memory_model.static_memory + 4e9 + 3000 * cm.memory_model.token_bytes(0)) / 2**30
    lengths = [9000, 5000, 2500, 700, 300, 200, 90]
    out: dict = {"lines": {}, "orders": {}, "created_in_step": {}, "wrong_ranks": []}
    pools = {}
    for scope in ("any", "node"):
        base = DCPConfig(memory_budget_gb=budget, ranks_per_node=1, ulysses_scope=scope,
                         attention_layout="hybrid", oversize="truncate")
        vocab = Vocabulary.for_cost_model(build_cost_model(model, base, world_size))
        pool = pools[scope] = GroupPool()
        out["lines"][scope] = pool.create_all(vocab)
        out["orders"][scope] = list(vocab.communicators())
        # every group holds its ranks in group order (sort_ranks=False), on every member
        for ranks in vocab.communicators():
            if rank in ranks and dist.get_process_group_ranks(pool.get(ranks)) != list(ranks):
                out["wrong_ranks"].append(ranks)
        for layout in ("hybrid", "auto"):
            for policy in POLICIES:
                config = base.replace(policy=policy, attention_layout=layout)
                plan = make_plan(lengths, world_size=world_size, model=model, config=config)
                key = (scope, layout, policy)
                out["created_in_step"][key] = pool.ensure(plan)
                out.setdefault("layouts", {})[key] = sorted({(t.degree, t.ulysses)
                                                             for t in plan.tasks})
        out.setdefault("member_of", {})[scope] = pool.report()["member_of"]
    out["in_node_pool"] = [g for g in pools["any"].vocabulary.communicators() if g in pools["node"]]
    if world_size > 1:
        # a hand-written plan: a group outside the vocabulary (reversed rank order) still works
        outside = (world_size - 1, 0)
        plan = Plan(tasks=(Task(id=0, ranks=outside, seqs=(0,), ulysses=1, ring=2),),
                    lengths=(8,), world_size=world_size)
        from megatron_dcp.runtime import groups as groups_module

        own_warm, warmed = groups_module.warm_group, []

        def counted(group, global_ranks, kinds):
            warmed.append(tuple(global_ranks))
            return own_warm(group, global_ranks, kinds)

        groups_module.warm_group = counted
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out["outside_created"] = pools["node"].ensure(plan)
        finally:
            groups_module.warm_group = own_warm
        out["outside_warmed"] = warmed
        out["warned"] = any("outside the start-up vocabulary" in str(w.message) for w in caught)
        t = torch.tensor([float(rank)])
        if rank in outside:
            dist.all_reduce(t, group=pools["node"].get(outside))
        out["outside_sum"] = float(t)
        out["report"] = pools["node"].report()
    dist.barrier()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_create_all_at_start_up(world_size):
    results = run_distributed(_startup_body, world_size, timeout_s=150)
    r0 = results[0]
    for res in results:
        # the same groups in the same fixed order on every rank; real groups, in group order
        assert res["orders"] == r0["orders"] and res["wrong_ranks"] == []
        # planner's plans (every policy, both layouts) create nothing inside the step
        assert set(res["created_in_step"].values()) == {0}, res["created_in_step"]
    for scope, order in r0["orders"].items():
        assert order == sorted(order, key=lambda g: (len(g), g))
        assert f"group pool: {len(order)} communicators" in r0["lines"][scope]
    if world_size == 1:
        assert r0["orders"] == {"any": [], "node": []}
        return
    # restriction: one rank per node, so the node scope allows no Ulysses across ranks; its pool
    # lacks the strided ring sub-groups of the default one
    node_layouts = {u for key, lay in r0["layouts"].items() if key[0] == "node" for _, u in lay}
    assert node_layouts == {1}
    if world_size == 4:
        any_ulysses = {u for key, lay in r0["layouts"].items() if key[0] == "any" for _, u in lay}
        assert any_ulysses > {1}
        assert set(r0["orders"]["any"]) - set(r0["orders"]["node"]) == {(0, 2), (1, 3)}
        assert (0, 2) not in r0["in_node_pool"] and (0, 1) in r0["in_node_pool"]
        assert [res["member_of"]["node"] for res in results] == [3, 3, 3, 2]
    # a group outside the vocabulary: created collectively in the step, counted, working
    outside = (world_size - 1, 0)
    for rank, res in enumerate(results):
        assert res["outside_created"] == 1 and res["warned"]
        # warmed where it is made (issue 46 item 9), by its members only
        assert res["outside_warmed"] == ([outside] if rank in outside else [])
        assert res["report"]["outside_vocabulary"] == 1
        assert res["outside_sum"] == (float(sum(outside)) if rank in outside else float(rank))


def _bound_body(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import ModelShape, Plan, Task, Vocabulary, build_cost_model
    from megatron_dcp.runtime.groups import GroupPool

    model = ModelShape(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=128,
                       vocab_size=256, name="tiny")
    pool = GroupPool(outside_limit=1)
    pool.create_all(Vocabulary.for_cost_model(build_cost_model(model, DCPConfig(), world_size)))
    last = world_size - 1
    a, b, c = (last, 0), (last - 1, 0), (last, 1)  # reversed: never in the vocabulary

    def plan_of(*groups):
        return Plan(tasks=tuple(Task(id=i, ranks=g, seqs=(i,), ulysses=1, ring=2)
                                for i, g in enumerate(groups)),
                    lengths=tuple(8 for _ in groups), world_size=world_size)

    alive, sums = [], []
    for groups in ((a,), (b,), (a,), (b, c) if last > 1 else (b,)):
        pool.ensure(plan_of(*groups))
        alive.append(sorted(g for g in (a, b, c) if g in pool))
        t = torch.tensor([float(rank)])
        if rank in groups[0]:  # the group just made (or kept) works
            dist.all_reduce(t, group=pool.get(groups[0]))
        sums.append(float(t))
    dist.barrier()
    return {"alive": alive, "report": pool.report(), "sums": sums}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [3, 4])
def test_groups_outside_the_vocabulary_are_bounded(world_size):
    """Issue 46, item 9: at most ``outside_limit`` groups made inside steps stay alive; the least
    recently used one is freed (destroyed by its members) when another is made, the same on
    every rank, never one the current plan uses; a freed group is made again when a plan needs
    it, and works."""
    results = run_distributed(_bound_body, world_size, timeout_s=150)
    last = world_size - 1
    a, b, c = (last, 0), (last - 1, 0), (last, 1)
    for rank, res in enumerate(results):
        assert res["alive"] == results[0]["alive"]
        assert res["alive"][:3] == [[a], [b], [a]]
        assert res["alive"][3] == sorted([b, c])  # both in the plan: kept over the limit
        assert res["report"]["outside_vocabulary"] == 5 and res["report"]["freed"] == 3
        first = [a, b, a, b]
        assert res["sums"] == [float(sum(g)) if rank in g else float(rank) for g in first]
