"""DCP ranks per node from the DCP world's own hosts (issue 46 item 6): ``LOCAL_WORLD_SIZE``
counts the job's processes on a host, which under tensor parallelism is not the DCP world's
(TP 2 on 2-GPU nodes: each data-parallel rank on its own node), so 8-rank blocks spanning nodes
were costed as NVLink."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from distributed import run_distributed

pytestmark = pytest.mark.slow  # a 4-rank launch


def _body(rank: int, world_size: int) -> dict:
    from megatron_dcp.runtime.hardware_auto import ranks_per_node_of

    host = f"node{rank // 2}"  # two processes (GPUs) per node
    tp_world = [r for r in range(world_size) if r % 2 == rank % 2]  # TP 2: DP = ranks 0,2 / 1,3
    groups = {tuple(w): dist.new_group(list(w)) for w in ([0, 2], [1, 3])}
    scattered = [f"node{r % 2}" for r in range(world_size)]  # a host's ranks not one block
    return {"tp2": ranks_per_node_of(groups[tuple(tp_world)], hostname=host),
            "dp4": ranks_per_node_of(None, hostname=host),
            "scattered": ranks_per_node_of(None, hostname=scattered[rank])}


def test_ranks_per_node_counts_the_dcp_worlds_own_hosts(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # what the launcher says: 2 processes a node
    results = run_distributed(_body, world_size=4)
    assert [r["tp2"] for r in results] == [1, 1, 1, 1]  # the DP world spans two nodes
    assert [r["dp4"] for r in results] == [2, 2, 2, 2]
    assert [r["scattered"] for r in results] == [1, 1, 1, 1]


def test_detect_hardware_takes_the_counted_ranks_over_local_world_size(monkeypatch):
    from megatron_dcp.runtime import hardware_auto

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert hardware_auto._ranks_per_node(1, 8) == 1
    assert hardware_auto._ranks_per_node(None, 8) == 8
