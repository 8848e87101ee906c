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
    assert len(hw.measured["model_points"]) == 8  # 3 lengths and the 16-token task, 2 depths
    # the pack curve the planner's default pack budget comes from (quick: 512-8192 tokens)
    assert [p["tokens"] for p in hw.measured["packs"]] == [512, 1024, 2048, 4096, 8192]
    assert hw.pack_curve and all(f > 0 for _, f in hw.pack_curve)
    assert hw.pack_tokens is None or hw.pack_tokens in (512, 1024, 2048, 4096)


def _tool():
    spec = importlib.util.spec_from_file_location("dcp_profile_tool",
                                                  os.path.join(ROOT, "tools", "profile.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_profile_fits_pack_budget_and_sequence_parallel_bandwidth():
    """The pure fitting steps: pack curve/budget from packed-task timings, and the bandwidth at
    which the cost model's communication matches a measured 2-rank task."""
    tool = _tool()
    cfg = tool.DecoderConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                             max_position=256)
    hw = tool._placeholder(1e11, 1e10, attention_flops=1e11, token_overhead_s=1e-6)
    per_token = {t: (10 + 0.001 * t) * 1e-6 for t in (512, 1024, 2048, 4096)}
    points = [{"tokens": t, "seq_len": 256, "seconds": t * s} for t, s in per_token.items()]
    curve, budget = tool.pack_curve(cfg, points, hw)
    assert budget == 1024  # the largest size within 10 % of the best per-token time
    factors = [f for _, f in curve]
    assert factors == sorted(factors) and factors[-1] > 1.2 * factors[0]  # smoothed, growing
    lengths = [256] * 4
    bw = tool.sp_bandwidth(cfg, lengths, 2, {"ulysses": 0.03, "ring": 0.02, "alone": 0.01},
                           latency=1e-5)
    assert set(bw) == {"ulysses", "ring"} and bw["ring"] > bw["ulysses"] > 0
    # no measurable extra time: no evidence against the raw all-to-all bandwidth
    assert tool.sp_bandwidth(cfg, lengths, 2, {"ring": 0.01, "alone": 0.01}, 1e-5) == {}
