"""tools/gpu_check.py in its CPU mode: every section runs and the exactness sections pass."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,skip", [("float32", ["profile"]),
                                        ("float64", ["profile", "megatron", "throughput"])])
def test_gpu_check_cpu_mode(tmp_path, dtype, skip):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"),
                          "--device", "cpu", "--dtype", dtype, "--out", str(out),
                          "--skip", *skip], capture_output=True, text=True, timeout=110, env=env,
                         cwd=ROOT)
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert res.returncode == 0, (summary, res.stdout[-3000:], res.stderr[-3000:])
    for name in ("environment", "exactness", "ring", "run_plan", "calibration"):
        assert summary[name] == "PASS", report["sections"][name]
    for name in skip:
        assert summary[name] == "SKIP"
    errors = report["sections"]["exactness"]["result"]["errors"]
    assert {"sdpa/causal", "torch/video-temporal"} <= set(errors)
    tol = 1e-10 if dtype == "float64" else 1e-5
    assert max(max(e.values()) for e in errors.values()) <= tol
    calibration = report["sections"]["calibration"]["result"]
    assert calibration["auto"] == "cpu-auto" and len(calibration["steps"]) == 8
    assert calibration["factors"] and calibration["steps"][-1]["calibration_error"] is not None
    rings = report["sections"]["ring"]["result"]["errors"]
    assert "causal/ulysses 1 x ring 8" in rings and "non-causal/ulysses 2 x ring 2" in rings
