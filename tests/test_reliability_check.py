"""The plan check also compares the DCP configuration and the global batch content across ranks:
ranks that disagree fail at once, naming the ranks (and the field or sequence), instead of
training on a wrong loss; ranks that agree pass with one collective."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from executor_cases import build_model, make_batch, plan_dict, shard_loss, task


def _disagreeing_ranks(rank: int, world_size: int) -> dict:
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.digests import PlanMismatchError
    from megatron_dcp.runtime.executor import run_plan
    from megatron_dcp.runtime.groups import GroupPool

    pool = GroupPool()
    model = build_model("decoder")
    lengths = (10, 20, 7)
    plan = Plan.from_dict(plan_dict([task(0, [0], [0, 1]), task(1, [world_size - 1], [2])],
                                    lengths, world_size))

    def run(batch, config) -> str:
        try:
            stats = run_plan(plan, batch, rank, shard_loss(model), pool=pool,
                             config=config)
            return f"ran {stats.loss:.6f}"
        except PlanMismatchError as exc:
            return str(exc)

    out = {}
    token, by_sequence = DCPConfig(enabled=True), DCPConfig(enabled=True, loss_reduction="token")
    if rank == 1:
        by_sequence = DCPConfig(enabled=True, loss_reduction="sequence", max_degree=2)
    out["good"] = run(make_batch(lengths, 48), token)
    # rank 1 runs with another loss reduction: same plan, formerly a silently wrong loss
    out["config"] = run(make_batch(lengths, 48), by_sequence)
    # rank 1 reads another token in sequence 1 (another data file, seed or sampler position)
    batch = make_batch(lengths, 48)
    if rank == 1:
        batch[1] = batch[1].clone()
        batch[1][3] += 1
    out["batch"] = run(batch, token)
    # a rank that holds only the sequences of its own tasks is not compared
    partial = make_batch(lengths, 48)
    if rank == 0:
        partial[2] = None
    out["partial"] = run(partial, token)
    # the group still works after the failed checks
    out["after"] = run(make_batch(lengths, 48), token)
    return out


@pytest.mark.slow
def test_config_and_batch_disagreements_name_the_ranks():
    results = run_distributed(_disagreeing_ranks, world_size=2)
    for rank, out in enumerate(results):
        assert out["good"].startswith("ran"), out
        assert out["partial"] == out["after"] == out["good"], out
        config = out["config"]
        assert config.startswith(f"rank {rank}: plan check failed"), config
        assert "DCP configuration differs on rank(s) [1]" in config
        assert "loss_reduction='sequence'" in config and "max_degree=2" in config
        assert "the other ranks: loss_reduction='token', max_degree=None" in config
        assert "plan digest" not in config
        batch = out["batch"]
        assert "global batch content differs on rank(s) [1] (first at sequence 1)" in batch
        assert "DCP configuration" not in batch


def test_batch_digest_sees_changed_and_swapped_tokens():
    from megatron_dcp.runtime.digests import batch_digest, sequence_digests

    batch = make_batch((9, 4, 12), 48)
    base = batch_digest(batch)
    assert len(base) == 16 and base == batch_digest([s.clone() for s in batch])
    assert base == batch_digest([s.to(torch.int32) for s in batch])  # values, not the dtype
    swapped = [s.clone() for s in batch]
    swapped[2][[0, 5]] = swapped[2][[5, 0]]
    assert swapped[2][0] != batch[2][0] and batch_digest(swapped) != base
    changed = [s.clone() for s in batch]
    changed[1][3] += 1
    assert batch_digest(changed) != base
    per, theirs = sequence_digests(batch), sequence_digests(swapped)
    assert len(per) == 3 and per[:2] == theirs[:2] and per[2] != theirs[2]
    assert batch_digest([batch[0], None]) is None and sequence_digests([None]) is None
