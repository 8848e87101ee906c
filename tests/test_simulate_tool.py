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


# ---------------------------------------------------------------- issue 59: outputs, sizes, replay


def _refused_at_parse(simulate, argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        simulate.parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_outputs_never_destroy_an_input_or_a_file_they_did_not_write(tools_on_path, tmp_path,
                                                                     capsys):
    import simulate

    lengths = tmp_path / "mylen.txt"
    lengths.write_text("100\n200\n")
    notes = tmp_path / "notes.png"
    notes.write_bytes(b"my picture")
    cases = [(["--lengths", str(lengths), "--save-plan", str(lengths)],
              f"--save-plan {lengths} is the input --lengths {lengths}: writing it would "
              "destroy that input"),
             (["--replay", str(lengths), "--plot", str(lengths), "--overwrite"], "the input"),
             (["--lengths", str(lengths), "--plot", str(notes)],
              f"--plot {notes} already exists and was not written by dcp-simulate: add "
              "--overwrite to replace it, or give another path"),
             (["--save-plan", str(notes)], "was not written by dcp-simulate"),
             (["--plot", str(tmp_path / "a.png"), "--save-plan", str(tmp_path / "a.png")],
              "--plot and --save-plan are the same file"),
             (["--save-plan", "/proc/version", "--overwrite"], "cannot be written")]
    for argv, message in cases:
        assert message in _refused_at_parse(simulate, argv, capsys), argv
    assert lengths.read_text() == "100\n200\n" and notes.read_bytes() == b"my picture"
    assert simulate.parse_args(["--plot", str(notes), "--overwrite"]).overwrite


def test_its_own_plot_and_plan_are_replaced_by_the_next_run(tmp_path):
    png, plan = tmp_path / "t.png", tmp_path / "p.json"
    flags = ["--gpus", "4", "--dist", "short", "--global-batch-tokens", "40000", "--policy",
             "dcp", "--plot", str(png), "--save-plan", str(plan)]
    for _ in range(2):
        proc = run_tool(*flags)
        assert proc.returncode == 0, proc.stderr
    assert b"dcp-simulate (megatron-dcp)" in png.read_bytes()[:4096]
    assert json.loads(plan.read_text())["meta"]["written_by"] == "dcp-simulate (megatron-dcp)"


@pytest.mark.parametrize("gpus, message", [
    ("1000000000", "argument --gpus: 1000000000: more than 1,048,576 ranks, the plan format's "
                   "cap"),
    ("2000000", "more than 1,048,576 ranks"),
    ("0", "argument --gpus: 0: must be >= 1"),
])
def test_a_world_above_the_plan_formats_cap_is_refused_at_parse(tools_on_path, capsys, gpus,
                                                                message):
    import simulate

    assert message in _refused_at_parse(simulate, ["--gpus", gpus], capsys)


@pytest.mark.parametrize("row, message", [
    ({"iteration": 1, "step_s": 0, "predicted_s": 0.5},
     "step_s 0 is not a positive number of seconds"),
    ({"iteration": 1, "step_s": "fast", "predicted_s": 0.5}, 'step_s "fast" is not'),
    ({"iteration": 1, "step_s": 1.0, "predicted_s": "x"}, 'predicted_s "x" is not'),
    ({"iteration": 1, "step_s": 1.0, "predicted_s": 0.5, "calibration_error": "c"},
     'calibration_error "c" is not a number'),
])
def test_replay_rows_of_the_wrong_type_name_their_line(tools_on_path, tmp_path, capsys, row,
                                                       message):
    import simulate

    log = tmp_path / "run.jsonl"
    log.write_text('{"iteration": 1, "step_s": 1.0, "predicted_s": 0.9}\n' + json.dumps(row)
                   + "\n")
    assert simulate.main(["--replay", str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {log}:2: ") and message in err and err.count("\n") == 1
