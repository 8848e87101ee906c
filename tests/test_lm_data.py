"""The launcher's global batch (`megatron_dcp.megatron.lm_data`, issue 43 item 5): each rank
receives the tokens of its own tasks' documents only, equal to the batch the sources hold, and
the lengths of all; every rank plans the same plan; a source's refusal stops every rank. Real
gloo processes (1, 2 and 4 ranks; at 4, two tensor-parallel ranks per data-parallel rank)."""

from __future__ import annotations

import numpy as np
import pytest
from distributed import run_distributed

pytestmark = pytest.mark.slow  # launches processes


def _batch(dp_rank: int) -> list:
    rng = np.random.default_rng(dp_rank)
    return [rng.integers(0, 255, size=int(n)) for n in rng.integers(3, 400, size=5)]


def _body(rank: int, world_size: int, tp: int, problem_at: int):
    import torch.distributed as dist

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.lm_data import global_batch, host_group
    from megatron_dcp.plan import make_plan, load_model

    dp_rank, source = rank // tp, rank % tp == 0
    local = _batch(dp_rank) if source else None

    def plan_of(lengths):
        return make_plan(lengths, world_size=world_size // tp, model=load_model("llama-7b"),
                         config=DCPConfig(enabled=True, hardware="h200", pack_tokens=200,
                                          memory_budget_gb=None))

    problem = "bad ids" if source and dp_rank == problem_at else ""
    try:
        sequences, plan = global_batch(local, dp_rank, problem, plan_of, host_group())
    except ValueError as err:
        return ("refused", str(err))
    mine = {s for t in plan.tasks if dp_rank in t.ranks for s in t.seqs}
    received = sum(int(s.numel()) for s in sequences if s is not None)
    dist.barrier()
    return ("ran", [None if s is None else s.tolist() for s in sequences], sorted(mine),
            plan.lengths, received)


@pytest.mark.parametrize("world_size, tp", [(1, 1), (2, 1), (4, 2)])
def test_each_rank_gets_its_tasks_documents_only(world_size, tp):
    full = [d.tolist() for dp in range(world_size // tp) for d in _batch(dp)]
    results = run_distributed(_body, world_size=world_size, args=(tp, -1))
    plans = {tuple(r[3]) for r in results}
    assert plans == {tuple(len(d) for d in full)}  # every rank: the lengths of all, in order
    for rank, (_, sequences, mine, _, received) in enumerate(results):
        assert [i for i, s in enumerate(sequences) if s is not None] == mine, rank
        assert all(sequences[i] == full[i] for i in mine), rank
        assert received == sum(len(full[i]) for i in mine)
    if world_size > 1:  # a split plan: not every rank holds every token
        assert any(r[4] < sum(map(len, full)) for r in results)


def test_a_sources_refusal_stops_every_rank():
    results = run_distributed(_body, world_size=4, args=(2, 1))
    assert all(r == ("refused", "bad ids") for r in results)


def test_the_exchange_runs_on_a_host_group_on_an_nccl_job(monkeypatch):
    """Issue 55: on the job's NCCL communicator the exchange made NCCL connect each new pair of
    ranks (about 0.23 GB a connection) at unpredictable steps, uncharged: an NCCL job gets a
    gloo group for it; a gloo job keeps its default group (no second group)."""
    import torch.distributed as dist

    from megatron_dcp.megatron import lm_data

    made = []
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or "host")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert lm_data.host_group() == "host" and made == [{"backend": "gloo"}]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert lm_data.host_group() is None and len(made) == 1
