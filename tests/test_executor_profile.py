"""tools/profile.py writes a profile JSON that the planner loads (tiny model, no comm test)."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_profile_writes_a_loadable_hardware_profile(tmp_path):
    spec = importlib.util.spec_from_file_location("dcp_profile_tool",
                                                  os.path.join(ROOT, "tools", "profile.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "cpu.json"
    assert tool.main(["--quick", "--ranks", "0", "--hidden", "32", "--layers", "2", "--heads",
                      "4", "--kv-heads", "2", "--ffn", "64", "--vocab", "64", "--lengths",
                      "32,64,128", "--repeat", "1", "--out", str(out)]) == 0
    from megatron_dcp.plan import load_hardware

    hw = load_hardware(str(out))
    assert hw.linear_flops > 0 and hw.attention_flops > 0
    assert hw.token_overhead_s is not None and hw.task_overhead_s is not None
    assert len(hw.measured["model_points"]) == 6
    # the pack curve the planner's default pack budget comes from (quick: 512-8192 tokens)
    assert [p["tokens"] for p in hw.measured["packs"]] == [512, 1024, 2048, 4096, 8192]
    assert hw.pack_curve and min(f for _, f in hw.pack_curve) == 1.0
    assert hw.pack_tokens is None or hw.pack_tokens in (512, 1024, 2048, 4096)
