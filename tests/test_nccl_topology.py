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


class _Pool:
    world_group = "dcp-world"
    job_group = None


def _driver(monkeypatch, hardware: str, *, device=None, backend: str = "nccl",
            ranks_per_node=None):
    """A StepDriver built as on an NCCL job whose DCP world has 2 ranks a host (the count and
    the backend stood in: no GPU here)."""
    import torch

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.runtime import groups, hardware_auto, step

    monkeypatch.setattr(hardware_auto, "ranks_per_node_of", lambda group: 2)
    monkeypatch.setattr(hardware_auto.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(groups, "comm_device", lambda group: torch.device(
        "cuda" if backend == "nccl" else "cpu"))
    seen = {}
    monkeypatch.setattr(hardware_auto, "detect_hardware",
                        lambda device, **kw: seen.setdefault("device", device))
    config = DCPConfig(enabled=True, hardware=hardware, ranks_per_node=ranks_per_node)
    driver = step.StepDriver(config, pool=_Pool(), device=device)
    return driver, seen


def test_a_preset_or_profile_on_cuda_counts_the_dcp_ranks_a_node(monkeypatch, tmp_path):
    """Issue 55: under TP 2 on 8-GPU nodes the DCP world has 4 ranks a node, but a preset said
    8 (and a dcp-profile file the 1-2 ranks it was measured on): the ranks per node are now
    counted from the DCP world's hosts on CUDA whatever names the hardware, unless
    dcp.ranks_per_node sets them; on the host (gloo) the preset's value stays."""
    import json

    from megatron_dcp.plan.hardware import load_hardware

    driver, _ = _driver(monkeypatch, "h100")
    assert load_hardware("h100").ranks_per_node == 8 and driver.hardware.ranks_per_node == 2
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({**load_hardware("h100").to_dict(), "ranks_per_node": 1}))
    assert _driver(monkeypatch, str(profile))[0].hardware.ranks_per_node == 2
    assert _driver(monkeypatch, "h100", ranks_per_node=8)[0].hardware.ranks_per_node == 8
    assert _driver(monkeypatch, "h100", backend="gloo")[0].hardware.ranks_per_node == 8


def test_an_nccl_job_without_a_device_starts_from_its_gpu(monkeypatch):
    """Issue 55: StepDriver(device=None) on an NCCL job started from the host's figures."""
    _, seen = _driver(monkeypatch, "auto")
    assert str(seen["device"]) == "cuda"
    _, seen = _driver(monkeypatch, "auto", backend="gloo")
    assert str(seen["device"]) == "cpu"
