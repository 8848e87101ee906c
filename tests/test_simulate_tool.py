"""tools/simulate.py end to end (subprocesses): table, --json schema, plans in and out, plot, and
bad input (a one-line error, exit status 2, no traceback)."""

import json
import os
import subprocess
import sys

import pytest

from megatron_dcp.plan.idx_format import write_lengths

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "simulate.py")
SMALL = ["--gpus", "8", "--gpus-per-node", "4", "--global-batch-tokens", "300000"]


def run_tool(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          timeout=timeout,
                          env=env, cwd=ROOT)


def test_table_for_every_policy():
    proc = run_tool(*SMALL, "--dist", "short")
    assert proc.returncode == 0, proc.stderr
    for name in ("dcp", "dcp-inter", "dcp-intra", "bucket", "packed", "static", "greedy-cp"):
        assert f"\n{name} " in proc.stdout
    assert "vs bucket" in proc.stdout and "lower bound" in proc.stdout
    assert "GiB of communicators per rank" in proc.stdout


def test_json_schema_and_saved_plan_round_trip(tmp_path):
    plan_path = str(tmp_path / "dcp.json")
    proc = run_tool(*SMALL, "--dist", "balanced", "--json", "--save-plan", plan_path, "--policy",
                    "dcp,bucket")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert isinstance(out["lower_bound_s"], float) and isinstance(out["tokens"], int)
    assert set(out["policies"]) == {"dcp", "bucket"}
    for entry in out["policies"].values():
        for key in ("step_time_s", "tokens_per_s", "efficiency", "imbalance", "plan_ms", "mfu"):
            assert isinstance(entry[key], float), key
        assert entry["efficiency"] <= 1.0 + 1e-9
    assert out["policies"]["dcp"]["step_time_s"] <= out["policies"]["bucket"]["step_time_s"]
    saved = json.load(open(plan_path))
    assert saved["policy"] == "dcp" and saved["tasks"]
    # evaluate the saved plan beside freshly made ones: same cost model, same step time
    proc = run_tool("--plan", plan_path, "--gpus-per-node", "4", "--policy", "dcp", "--json")
    assert proc.returncode == 0, proc.stderr
    again = json.loads(proc.stdout)["policies"]
    assert again["plan:dcp.json"]["step_time_s"] == pytest.approx(again["dcp"]["step_time_s"])
    expected = out["policies"]["dcp"]["step_time_s"]
    assert again["plan:dcp.json"]["step_time_s"] == pytest.approx(expected)


def test_lengths_file_idx_and_plot(tmp_path):
    lengths = tmp_path / "batch.txt"
    lengths.write_text("\n".join(str(n) for n in [100, 2000, 40000, 512, 9000]) + "\n")
    idx = str(tmp_path / "d.idx")
    write_lengths(idx, [100, 2000, 40000, 512, 9000])
    a = run_tool("--gpus", "4", "--lengths", str(lengths), "--json", "--policy", "dcp")
    b = run_tool("--gpus", "4", "--idx", idx, "--json", "--policy", "dcp")
    c = run_tool("--gpus", "4", "--lengths", idx, "--json", "--policy", "dcp")
    for proc in (a, b, c):
        assert proc.returncode == 0, proc.stderr
    digests = {json.loads(p.stdout)["policies"]["dcp"]["digest"] for p in (a, b, c)}
    assert len(digests) == 1
    png = tmp_path / "t.png"
    proc = run_tool("--gpus", "4", "--lengths", str(lengths), "--policy", "dcp,bucket", "--plot",
                    str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content, args, message", [
    ("10\n-3\n", [], "length -3 must be >= 1"),
    ("10\n2.5\n", [], "'2.5' is not an integer"),
    ("", [], "empty"),
    ("100\n", ["--model", "llama-8b"], "unknown model 'llama-8b'"),
    ("100\n", ["--hardware", "tpu9"], "unknown hardware 'tpu9'"),
    ("100\n", ["--memory-budget-gb", "5"], "below the static memory"),
    ("100\n5000000\n", [], "sequence 1 has 5000000 tokens"),
    ("100\n", ["--policy", "fastest"], "unknown fastest"),
    ("100\n", ["--hardware", "/nonexistent/profile.json"], "does not exist"),
])
def test_bad_input_is_a_clear_error(tmp_path, content, args, message):
    path = tmp_path / "lengths.txt"
    path.write_text(content)
    proc = run_tool("--gpus", "2", "--lengths", str(path), *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ")


def test_non_finite_profile_is_a_clear_error_not_a_hang(tmp_path):
    # NaN passed validation once and the dcp planner spun forever on it
    profile = tmp_path / "nan.json"
    profile.write_text('{"base": "h200", "task_overhead_s": NaN}')
    proc = run_tool("--gpus", "8", "--dist", "short", "--global-batch-tokens", "100000",
                    "--policy", "dcp", "--hardware", str(profile), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "nan.json" in proc.stderr and "task_overhead_s=nan" in proc.stderr


def test_missing_files_are_clear_errors(tmp_path):
    for args in (["--lengths", str(tmp_path / "nope.txt")], ["--plan", str(tmp_path / "nope.json")],
                 ["--idx", str(tmp_path / "nope.idx")]):
        proc = run_tool(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"tasks": []}')
    proc = run_tool("--plan", str(bad))
    assert proc.returncode == 2 and "world_size" in proc.stderr


def test_virtual_pipeline_with_sequence_parallelism():
    # --vpp: the interleaved schedule runs a count it accepts (padded to a multiple of P here);
    # --sequence-parallel reaches the model
    proc = run_tool("--gpus", "8", "--model", "llama-70b", "--tp", "8", "--pp", "4", "--vpp", "2",
                    "--sequence-parallel", "--global-batch-tokens", "200000", "--dist", "long",
                    "--policy", "static", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["sequence_parallel"] and out["virtual_pipeline"] == 2
    static = out["policies"]["static"]
    assert static["micro_batches"] % 4 == 0, static


def test_dataset_batches_cut_as_the_launcher_reads_them():
    """`dataset_batch` (issue 45, item 5): batch k starts k x tokens into the documents laid end
    to end; with a sample length the stream is cut into samples and every document piece of a
    sample, with its last token's target, is a sequence; a budget larger than the dataset is
    refused, not silently planned as the whole dataset."""
    from megatron_dcp.plan.workload import WorkloadError, dataset_batch

    docs = [5, 3, 10, 2]
    assert dataset_batch(docs, 8) == [5, 3]
    assert dataset_batch(docs, 12, seq_length=4) == [5, 2, 4, 5]  # samples [0,4) [4,8) [8,12)
    assert dataset_batch(docs, 8, batch=1, seq_length=4) == [5, 5]
    assert dataset_batch(docs, 8, batch=2, seq_length=4) == [3, 3, 5]  # wraps to the start
    assert dataset_batch([100], 50, max_len=30) == [30]
    with pytest.raises(WorkloadError, match="more than the dataset holds"):
        dataset_batch(docs, 21)
    with pytest.raises(WorkloadError, match="holds no sample"):
        dataset_batch(docs, 3, seq_length=4)


def test_idx_with_a_batch_budget_plans_a_batch_not_the_dataset(tmp_path):
    idx = str(tmp_path / "d.idx")
    write_lengths(idx, [100, 2000, 40000, 512, 9000])
    whole = run_tool("--gpus", "4", "--idx", idx, "--json", "--policy", "dcp")
    batch = run_tool("--gpus", "4", "--idx", idx, "--json", "--policy", "dcp",
                     "--global-batch-tokens", "16384", "--seq-length", "4096")
    for proc in (whole, batch):
        assert proc.returncode == 0, proc.stderr
    assert json.loads(whole.stdout)["tokens"] == 51612
    out = json.loads(batch.stdout)
    assert out["tokens"] == 16384 + out["sequences"]  # 4 samples; each piece + its target
    assert out["sequences"] == 6  # samples [100, 2000, 1996 | 4096 | 4096 | 4096], + 1 each
    refused = run_tool("--gpus", "4", "--idx", idx, "--global-batch-tokens", "99999999")
    assert refused.returncode == 2 and "more than the dataset holds" in refused.stderr
