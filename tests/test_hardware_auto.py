"""``--dcp_hardware auto`` on CUDA, with fake device properties: presets matched by the exact
model, the device's real memory and the launcher's ranks per node in place of the preset's."""

from types import SimpleNamespace

import pytest
import torch

from megatron_dcp.plan.hardware import PRESETS
from megatron_dcp.runtime import hardware_auto
from megatron_dcp.runtime.hardware_auto import detect_hardware, preset_for_device_name

GB = 1024**3
CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(name, memory, visible)``: what torch.cuda reports on a machine with that GPU."""
    def install(name, total_memory, visible=8):
        props = SimpleNamespace(name=name, total_memory=total_memory)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return install


@pytest.mark.parametrize("name, key, memory", [
    ("NVIDIA H200", "h200", 141e9),
    ("NVIDIA H200 NVL", "h200-nvl", 141e9),
    ("NVIDIA GH200 480GB", "gh200", 96e9),  # not the H200 preset
    ("NVIDIA H100 80GB HBM3", "h100", 80e9),
    ("NVIDIA H100 PCIe", "h100-pcie", 80e9),
    ("NVIDIA H100 NVL", "h100-nvl", 94e9),
    ("NVIDIA A100-SXM4-80GB", "a100", 80e9),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb", 40e9),  # not the 80 GB preset
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb", 40e9),
    ("NVIDIA A100 80GB PCIe", "a100-pcie", 80e9),
])
def test_names_match_the_exact_model(name, key, memory):
    hw = preset_for_device_name(name)
    assert hw.name == key and hw.hbm_bytes == memory
    sxm = PRESETS["h100"].intra_bandwidth
    assert (hw.intra_bandwidth < sxm / 4) == ("pcie" in key or "nvl" in key)


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA H20", "NVIDIA L40S"])
def test_other_gpus_have_no_preset(name):
    assert preset_for_device_name(name) is None


@pytest.mark.parametrize("name, total, local, visible, rpn", [
    ("NVIDIA A100-SXM4-40GB", 40 * GB, "4", 4, 4),  # a 4-GPU node
    ("NVIDIA H100 80GB HBM3", 80 * GB, None, 8, 8),
    ("NVIDIA H200", 70 * GB, "8", 8, 8),  # a MIG slice or a capped device: real memory
    ("NVIDIA GH200 480GB", 95 * GB, None, 1, 1),
    ("NVIDIA H100 PCIe", 80 * GB, "2", 2, 2),
])
def test_real_memory_and_local_world_size_override_the_preset(fake_gpu, monkeypatch, name,
                                                              total, local, visible, rpn):
    fake_gpu(name, total, visible)
    if local is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    hw = detect_hardware(CUDA)
    assert hw.name == preset_for_device_name(name).name
    assert hw.hbm_bytes == total and hw.ranks_per_node == rpn


def test_ranks_per_node_without_a_launcher_count(fake_gpu):
    """The caller's count (the DCP world's own hosts: a process may see one GPU while its host
    runs 16 ranks); without it, at most the GPUs this process sees."""
    fake_gpu("NVIDIA H100 80GB HBM3", 80 * GB, visible=4)
    assert detect_hardware(CUDA, local_ranks=16).ranks_per_node == 16
    assert detect_hardware(CUDA).ranks_per_node == 4
    assert detect_hardware(CUDA, local_ranks=2).ranks_per_node == 2


def test_unknown_gpu_keeps_the_measured_gemm_rate(fake_gpu, monkeypatch):
    fake_gpu("NVIDIA L40S", 48 * GB, visible=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(hardware_auto, "_gemm_flops", lambda device: 3e14)
    hw = detect_hardware(CUDA)
    base = PRESETS["h100"]
    assert hw.name == "cuda-auto (NVIDIA L40S)" and hw.linear_flops == 3e14
    assert hw.attention_flops == pytest.approx(base.attention_flops * 3e14 / base.linear_flops)
    assert hw.hbm_bytes == 48 * GB and hw.ranks_per_node == 4
