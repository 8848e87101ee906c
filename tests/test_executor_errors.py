"""Bad input to `run_plan`: clear errors on every rank, never a hang, and the group stays usable."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from distributed import DistributedError, run_distributed
from executor_cases import build_model, make_batch, plan_dict, reference, shard_loss, task


def _run(plan, rank, model, pool):
    from megatron_dcp.runtime.executor import run_plan

    batch = make_batch(plan.lengths, model.config.vocab_size)
    return run_plan(plan, batch, rank, shard_loss(model), pool=pool,
                    max_position=model.config.max_position)


def _bad_inputs(rank: int, world_size: int) -> dict:
    """Digest mismatch, too-long sequence, batch/plan disagreement; then a good plan still runs."""
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.digests import BatchError, PlanMismatchError
    from megatron_dcp.runtime.groups import GroupPool

    pool = GroupPool()
    model = build_model("decoder")
    out = {}
    lengths = (10, 20, 7)
    good = Plan.from_dict(plan_dict([task(0, [0], [0, 1]), task(1, [world_size - 1], [2])],
                                    lengths, world_size))
    # 1. Rank 1 plans with another start time: the digest differs only there.
    mine = good
    if rank == 1:
        mine = Plan.from_dict(plan_dict([task(0, [0], [0, 1], start=0.5),
                                         task(1, [world_size - 1], [2])], lengths, world_size))
    try:
        _run(mine, rank, model, pool)
        out["digest"] = "no error"
    except PlanMismatchError as exc:
        out["digest"] = str(exc)
    # 2. A sequence longer than max_position (64): every rank raises, naming it.
    long_plan = Plan.from_dict(plan_dict([task(0, [0], [0]), task(1, [world_size - 1], [1])],
                                         (10, 70), world_size))
    try:
        _run(long_plan, rank, model, pool)
        out["too_long"] = "no error"
    except BatchError as exc:
        out["too_long"] = str(exc)
    # 3. The batch given to the last rank does not match the plan's lengths.
    from megatron_dcp.runtime.executor import run_plan

    batch = make_batch(lengths, 48)
    if rank == world_size - 1:
        batch[2] = batch[2][:5]
    try:
        run_plan(good, batch, rank, shard_loss(model), pool=pool)
        out["batch"] = "no error"
    except BatchError as exc:
        out["batch"] = str(exc)
    # 4. A structurally invalid plan (sequence 2 in no task): every rank raises.
    holes = Plan.from_dict(plan_dict([task(0, [0], [0, 1])], lengths, world_size))
    try:
        _run(holes, rank, model, pool)
        out["invalid"] = "no error"
    except BatchError as exc:
        out["invalid"] = str(exc)
    # 5. Per-sequence mean needs per-token losses from forward_step, not their sum.
    from megatron_dcp.runtime.executor import TaskError

    try:
        run_plan(good, make_batch(lengths, 48), rank, shard_loss(model),
                 pool=pool, loss_reduction="sequence")
        out["sequence"] = "no error"
    except TaskError as exc:
        out["sequence"] = str(exc)
    # 6. The group is not poisoned: a good plan still runs.
    model.zero_grad()
    out["after"] = _run(good, rank, model, pool).loss
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_input_raises_on_every_rank():
    t0 = time.monotonic()
    results = run_distributed(_bad_inputs, 2)
    assert time.monotonic() - t0 < 60, "errors must not wait for a timeout"
    for rank, res in enumerate(results):
        assert "plan digest differs on rank(s) [1]" in res["digest"], res["digest"]
        assert "sequence 1 has 70 tokens" in res["too_long"], res["too_long"]
        assert "max_position 64" in res["too_long"]
        assert "rank 1: sequence 2 of task 1" in res["batch"], res["batch"]
        assert "holds shape (5,)" in res["batch"]
        assert "invalid plan: sequence(s) [2] are in no task" in res["invalid"], res["invalid"]
        assert "needs forward_step to return per-token losses" in res["sequence"], res["sequence"]
        assert res["sequence"].startswith(f"rank {rank}: task {rank}"), res["sequence"]
    ref_loss, _ = reference("decoder", (10, 20, 7))
    assert abs(results[0]["after"] - ref_loss) <= 1e-5 * ref_loss


def test_model_names_position_beyond_max():
    model = build_model("decoder")
    ids = torch.zeros(65, dtype=torch.long)
    with pytest.raises(ValueError, match="position 64 is beyond max_position=64"):
        model(ids)


def _timeout_body(rank: int, world_size: int) -> str:
    """Rank 1 never runs its share of a degree-2 task: rank 0's collective times out."""
    import torch.distributed as dist

    from megatron_dcp.plan.plan import Plan
    import megatron_dcp.runtime.executor as ex
    from megatron_dcp.runtime.groups import GroupPool

    pool = GroupPool(timeout=timedelta(seconds=3))
    model = build_model("decoder")
    # Ranks (1, 0): a group of its own with the pool's 3 s timeout (not the world group).
    plan = Plan.from_dict(plan_dict([task(5, [1, 0], [0, 1], ulysses=2)], (12, 8), 2))
    pool.ensure(plan)
    if rank == 1:
        dist.barrier()  # wait (on the world group) until rank 0 has seen its timeout
        return "skipped"
    try:
        # Skip the digest check (its collective is on the world group): go straight to the task.
        ex.check_plan = lambda *a, **k: plan.digest()
        ex.run_plan(plan, make_batch(plan.lengths, 48), rank, shard_loss(model),
                    pool=pool)
        return "no error"
    except ex.TaskError as exc:
        return str(exc)
    finally:
        dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_collective_timeout_names_rank_and_task():
    try:
        results = run_distributed(_timeout_body, 2, group_timeout_s=30)
    except DistributedError as exc:  # a poisoned gloo group may also abort at teardown
        pytest.fail(str(exc))
    msg = results[0]
    assert msg.startswith("rank 0: task 5 (ranks (1, 0), ulysses 2 x ring 1"), msg
    assert "timed out" in msg, msg


def _worlds_body(rank: int, world_size: int) -> str:
    """Two DCP worlds (0, 2) and (1, 3), as under tensor parallelism 2; rank 3's world plans
    differently (another start time): the plan check must fail on every rank of the job."""
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.digests import PlanMismatchError
    from megatron_dcp.runtime.groups import GroupPool

    pool = GroupPool(all_worlds=[(0, 2), (1, 3)])
    model = build_model("decoder")
    lengths = (10, 20)
    start = 0.5 if rank in (1, 3) else 0.0
    plan = Plan.from_dict(plan_dict([task(0, [0], [0], start=start), task(1, [1], [1])],
                                    lengths, 2))
    try:
        _run(plan, pool.rank, model, pool)
        return "no error"
    except PlanMismatchError as exc:
        return str(exc)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plans_that_differ_between_dcp_worlds_fail_the_check():
    """Tensor-parallel peers sit in different DCP worlds and must run the same tasks: the plan
    check compares plans job-wide (a world-local check passed both worlds, then hung)."""
    results = run_distributed(_worlds_body, 4, timeout_s=100)
    for rank, msg in enumerate(results):
        assert msg.startswith(f"rank {rank}: plan check failed"), msg
        assert "plan digest differs on rank(s) [1, 3]" in msg, msg
