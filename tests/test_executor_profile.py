"""The hardware profiler (`megatron_dcp.profiling`, CLI tools/profile_hardware.py): it writes a
profile the planner loads, with ring and hybrid attention rates measured apart from local ones,
and its fits recover known coefficients."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_dcp.plan import load_hardware
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.profiling import fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "profile_hardware.py")
TINY = ["--quick", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn",
        "64", "--vocab", "64", "--lengths", "32,64,128", "--repeat", "1"]
SHAPE = ModelShape(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=64,
                   num_kv_heads=2, name="decoder")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_profile_measures_ring_tasks_on_two_ranks(tmp_path):
    # run as a script, as users do: tools/ is then first on sys.path, where a file named like
    # the standard library's `profile` used to break `import cProfile` (torch._dynamo needs it)
    out = tmp_path / "cpu.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, TOOL, *TINY, "--ranks", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=170, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attention (local/ring/hybrid)" in proc.stdout
    hw = load_hardware(str(out))
    assert hw.linear_flops > 0 and hw.attention_flops > 0 and hw.comm_overlap == 0.0
    assert hw.token_overhead_s is not None and hw.task_overhead_s is not None
    assert len(hw.measured["model_points"]) == 8  # 3 lengths and the 16-token task, 2 depths
    # the pack curve the planner's default pack budget comes from (quick: 512-8192 tokens)
    assert [p["tokens"] for p in hw.measured["packs"]] == [512, 1024, 2048, 4096, 8192]
    assert hw.pack_curve and all(f > 0 for _, f in hw.pack_curve)
    # ring tasks on 2 gloo ranks: a rate of their own, fitted to their measured times
    multi = hw.measured["multi_rank"]
    assert [p["length"] for p in multi["ring"]] == [512, 1024]
    assert all(p["ring"] == 2 and p["seconds"] > 0 and "rel_error" in p for p in multi["ring"])
    assert math.isfinite(hw.ring_attention_flops) and hw.ring_attention_flops > 0
    assert hw.hybrid_attention_flops == hw.ring_attention_flops  # hybrid needs 4 ranks
    assert multi["hybrid_rate"].startswith("ring's")
    assert hw.communicator_bytes == 0.0 and hw.ranks_per_node == 2


@pytest.mark.slow
def test_unwritable_output_fails_before_measuring(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = subprocess.run([sys.executable, TOOL, *TINY, "--ranks", "0", "--out",
                           str(blocker / "sub" / "p.json")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode != 0
    assert "cannot write the profile" in proc.stderr and "GEMM" not in proc.stdout


def test_fits_recover_known_coefficients():
    """Timings made by the cost model itself from known numbers are fitted back to them."""
    truth = fit.placeholder(2e11, 1e10, attention_flops=5e10, token_overhead_s=2e-6,
                            task_overhead_s=3e-3)
    points = [{"length": n, "recompute_layers": c} for n in (16, 128, 512, 2048) for c in (0, 2)]
    points += [{"tokens": t, "seq_len": 256} for t in (512, 2048)]
    timed = [{**p, "seconds": p_["predicted"]}
             for p, p_ in zip(points, fit.predictions(SHAPE, points, truth))]
    coeffs, report = fit.fit_profile(SHAPE, timed, 2e11, 1e10)
    assert coeffs["attention_flops"] == pytest.approx(5e10, rel=1e-6)
    assert coeffs["token_overhead_s"] == pytest.approx(2e-6, rel=1e-6)
    assert coeffs["task_overhead_s"] == pytest.approx(3e-3, rel=1e-6)
    assert max(abs(r["rel_error"]) for r in report) < 1e-9
    # a ring rate of its own, from 2-rank ring tasks, with links and overlap as on a CPU
    links = replace(truth, intra_bandwidth=2e8, intra_latency=1e-4, comm_overlap=0.0,
                    ranks_per_node=2)
    ring = [{"length": n, "ulysses": 1, "ring": 2} for n in (512, 1024, 2048)]
    slow = replace(links, ring_attention_flops=2e10)
    ring = [{**p, "seconds": q["predicted"]}
            for p, q in zip(ring, fit.predictions(SHAPE, ring, slow, world=2))]
    rate = fit.fit_layout_rate(SHAPE, ring, links, "ring_attention_flops", world=2)
    assert rate == pytest.approx(2e10, rel=0.02)


def test_pack_budget_and_ulysses_bandwidth():
    """The pack curve/budget from packed-task timings, and the bandwidth at which the cost
    model's all-to-all matches a measured 2-rank Ulysses task."""
    hw = fit.placeholder(1e11, 1e10, attention_flops=1e11, token_overhead_s=1e-6)
    per_token = {t: (10 + 0.001 * t) * 1e-6 for t in (512, 1024, 2048, 4096)}
    points = [{"tokens": t, "seq_len": 256, "seconds": t * s} for t, s in per_token.items()]
    curve, budget = fit.pack_curve(SHAPE, points, hw)
    assert budget == 1024  # the largest size within 10 % of the best per-token time
    factors = [f for _, f in curve]
    assert factors == sorted(factors) and factors[-1] > 1.2 * factors[0]  # smoothed, growing
    lengths = [256] * 4
    slow = fit.ulysses_bandwidth(SHAPE, lengths, 2, 0.03, 0.01, latency=1e-5)
    fast = fit.ulysses_bandwidth(SHAPE, lengths, 2, 0.02, 0.01, latency=1e-5)
    assert 0 < slow < fast and fast == pytest.approx(2 * slow, rel=0.01)
    # no measurable extra time: no evidence against the raw all-to-all bandwidth
    assert fit.ulysses_bandwidth(SHAPE, lengths, 2, 0.01, 0.01, latency=1e-5) is None
