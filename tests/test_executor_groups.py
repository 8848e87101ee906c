"""`GroupPool` on gloo: collective creation, caching, lookup, task contexts, sub-worlds."""

from __future__ import annotations

import pytest

from distributed import run_distributed


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
    out["vocab_created"] = pool.ensure_all([(0, 1), (2, 3), (0, 1, 2, 3)])
    out["report"] = pool.report()
    from megatron_dcp.plan import Vocabulary

    vocab = Vocabulary(4, 4)
    pool.ensure_all(vocab)
    out["vocab_all"] = all(tuple(g) in pool for g in vocab.groups() if len(g) > 1)
    # Two DCP worlds (like tensor parallelism 2): (0, 2) and (1, 3). Only world (0, 2) needs a
    # ring group; the other world creates it along (creation is job-wide).
    sub = GroupPool(all_worlds=[(0, 2), (1, 3)])
    tasks = (Task(id=0, ranks=(1, 0), seqs=(0,), ulysses=1, ring=2),) if rank in (0, 2) else ()
    sub_plan = Plan(tasks=tasks, lengths=(8,), world_size=2)
    out["sub_created"] = sub.ensure(sub_plan)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=sub.get((1, 0)))
    out["sub_sum"] = float(t)
    out["sub_rank"] = (sub.rank, dist.get_rank(sub.get((1, 0))))
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
    # vocabulary: (0,1), (2,3), (0,1,2,3) (= the world group, reused) and the Ulysses/ring
    # sub-groups of (0,1,2,3) at u=2: (0,1), (2,3), (0,2), (1,3) -> 4 new groups
    assert r0["vocab_created"] == 4
    assert r0["report"]["groups"] == 1 + 6 + 4
    assert all(res["vocab_all"] for res in results)
    assert [res["sub_sum"] for res in results] == [2.0, 4.0, 2.0, 4.0]
    assert [res["sub_created"] for res in results] == [1, 1, 1, 1]
    assert all(res["sub2_worlds"] == [(0, 2), (1, 3)] for res in results)
    assert [res["sub_rank"] for res in results] == [(0, 1), (0, 1), (1, 0), (1, 0)]
