"""The dry run (issue 43): every rank of a 16-rank job at real width (Llama-7B layers, bf16) on
the meta device under torch's fake process group, in this process; collectives recorded and
checked across ranks (the Megatron path: tests/test_megatron_dryrun.py). Negative controls: a
rank that skips one collective, two swapped collectives, and a host tensor handed to a
collective are each caught."""

from __future__ import annotations

import json

import pytest

from megatron_dcp.dryrun.__main__ import parse_args, run
from megatron_dcp.dryrun.record import Call, check_consistency


def _run(*flags: str, **controls):
    return run(parse_args(["--gpus", "16", "--layers", "1", "--global-batch-tokens", "65536",
                           *flags]), **controls)


def test_sixteen_ranks_at_real_width_issue_the_same_collectives():
    report = _run()
    assert report["ok"] and report["consistent"], report["mismatches"][:2]
    assert len(report["ranks"]) == 16 and report["tokens"] == 65536
    for r in report["ranks"]:
        assert r["error"] == "" and r["cpu_tensors"] == 0
        assert r["collectives"] > 0 and r["predicted_bytes"] > 2**30  # an 8B-wide layer
        # the step's host reads, by call site: the plan check, the loss, the non-finite check
        assert any("digests.py" in site for site in r["host_syncs"]), r["host_syncs"]


def test_a_rank_that_skips_one_collective_is_named():
    report = _run("--ranks", "0,1,2,3", drop_call=(2, 1))  # its all-to-all warming (2, 3)
    assert not report["ok"] and not report["consistent"]
    named = [m for m in report["mismatches"]
             if 2 in m.get("group", [m.get("send"), m.get("recv")])]
    assert named, report["mismatches"]


def test_a_host_tensor_in_a_collective_is_an_error_at_the_call():
    report = _run("--ranks", "0,1", cpu_tensor_at=1)
    assert not report["ok"]
    bad = report["ranks"][1]
    assert bad["cpu_tensors"] == 1 and "given a tensor on cpu" in bad["error"]
    assert "NCCL would refuse it" in bad["error"] and report["ranks"][0]["cpu_tensors"] == 0


def test_swapped_collectives_and_unmatched_sends_are_caught():
    a = Call("allreduce_", (0, 1), ((4,),), "torch.float32")
    b = Call("alltoall_base_", (0, 1), ((8,), (8,)), "torch.bfloat16")
    assert check_consistency({0: [a, b], 1: [a, b]}) == []
    swapped = check_consistency({0: [a, b], 1: [b, a]})
    assert swapped and swapped[0]["index"] == 0 and swapped[0]["group"] == [0, 1]
    send = Call("send", (0, 1), ((16,),), "torch.bfloat16", peer=1)
    recv = Call("recv_", (0, 1), ((16,),), "torch.bfloat16", peer=0)
    assert check_consistency({0: [send], 1: [recv]}) == []
    short = Call("recv_", (0, 1), ((8,),), "torch.bfloat16", peer=0)
    assert check_consistency({0: [send], 1: [short]})[0]["send"] == 0
    assert check_consistency({0: [send], 1: []})[0]["received"] == "no receive"


def test_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        _run("--ranks", "3,99")
    assert "argument --ranks: 3,99: [99] outside 0..15" in capsys.readouterr().err


def test_a_long_task_tiles_and_its_offloaded_inputs_leave_the_device(tmp_path):
    """One 300,000-token sequence on 2 ranks at Llama-7B width, 4 layers: `long_sequences`
    auto plans it with MLP and loss tiles, and at 37.5 GiB a rank with 2 of its 4 recomputed
    layers' inputs offloaded. The dry run sends an offloaded input to the host as a GPU would
    (a placeholder there), so the device's peak is lower than at 39.6 GiB (no offload, the
    same tiles) by two layer inputs, as the memory model counts; every collective consistent,
    no host tensor in one; the measured peak within the prediction and above 90 % of it."""
    lengths = tmp_path / "long.txt"
    lengths.write_text("300000\n")

    def dry(budget: str) -> dict:
        return run(parse_args(["--gpus", "2", "--layers", "4", "--lengths", str(lengths),
                               "--max-len", "300000", "--global-batch-tokens", "300000",
                               "--memory-budget-gb", budget, "--ranks", "0"]))

    offloaded, kept = dry("37.5"), dry("39.6")
    for report in (offloaded, kept):
        assert report["consistent"] and report["ranks"][0]["error"] == "", report["ranks"]
        assert report["ranks"][0]["cpu_tensors"] == 0
    layer_input = 150_000 * 4096 * 2  # local tokens x hidden x bf16
    # 2 inputs offloaded: 2 fewer on the device at the peak (measured exactly 2 x 1.23 GB; on
    # the device they stay: no difference)
    saved = kept["ranks"][0]["peak_bytes"] - offloaded["ranks"][0]["peak_bytes"]
    assert saved > 1.9 * layer_input, saved
    for report in (offloaded, kept):  # measured 0.94x: the model counts a little more
        rank = report["ranks"][0]
        assert 0.9 * rank["predicted_bytes"] < rank["peak_bytes"] <= rank["predicted_bytes"]


@pytest.mark.slow  # in-process, but 10-25 s: out of the fast tier
def test_long_sequences_and_optimizer_offload_follow_their_flags(tmp_path):
    """``--long-sequences off`` plans as training with the flag off (a 300,000-token sequence on
    2 ranks fits no group: the rank reports the planner's error); ``--offload-optimizer`` takes
    the optimizer states out of the static memory, so the same budget leaves the long task more
    (fewer layer inputs offloaded, a higher predicted peak of activations)."""
    lengths = tmp_path / "long.txt"
    lengths.write_text("300000\n")
    flags = ["--gpus", "2", "--layers", "4", "--lengths", str(lengths), "--max-len", "300000",
             "--global-batch-tokens", "300000", "--memory-budget-gb", "32", "--ranks", "0",
             "--zero-stage", "1"]
    off = run(parse_args(flags + ["--long-sequences", "off"]))
    assert "fits no group" in off["ranks"][0]["error"] and not off["ok"]
    kept = run(parse_args(flags))["ranks"][0]
    offloaded = run(parse_args(flags + ["--offload-optimizer"]))["ranks"][0]
    assert kept["error"] == offloaded["error"] == ""
    assert offloaded["predicted_bytes"] > kept["predicted_bytes"]  # 19.3 vs 17.0 GiB
    assert offloaded["peak_bytes"] > kept["peak_bytes"]  # measured: 18.3 vs 16.0


# ------------------------------------------------------- issue 59: flags refused before any rank


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "0"], "argument --gpus: 0: must be >= 1"),
    (["--gpus", "-4"], "argument --gpus: -4: must be >= 1"),
    (["--gpus", "2000000"], "argument --gpus: 2000000: more than 1,048,576 ranks, the plan "
                            "format's cap"),
    (["--ranks", ""], "argument --ranks: '' names no rank"),
    (["--ranks", "0,abc"], "argument --ranks: '0,abc': all, or a comma list of ranks"),
    (["--max-len", "0"], "argument --max-len: 0: must be >= 2"),
    (["--global-batch-tokens", "0"], "argument --global-batch-tokens: 0: must be >= 2"),
    (["--global-batch-tokens", "-5"], "argument --global-batch-tokens: -5: must be >= 2"),
    (["--engine", "megatron", "--sequence-parallel"], "--sequence-parallel needs --tp > 1"),
    (["--engine", "megatron", "--tp", "2", "--zero-stage", "3"],
     "--zero-stage 3: the Megatron engine shards only the optimizer"),
    (["--sequence-parallel"], "--sequence-parallel: the runtime engine's reference decoder"),
])
def test_a_flag_that_would_run_nothing_or_something_else_is_refused(flags, message, capsys,
                                                                    monkeypatch):
    """Refused while parsing, naming the flag, status 2: no rank runs (it used to print
    "consistent: True" for 0 ranks, run the default batch for 0 tokens, drop SP silently)."""
    import megatron_dcp.dryrun.runtime_rank as ranks

    monkeypatch.setattr(ranks, "run_rank", lambda *a: pytest.fail("a rank ran"))
    from megatron_dcp.dryrun.__main__ import main

    with pytest.raises(SystemExit) as stop:
        main(flags)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("dcp-dry-run: error: ")


def test_json_never_destroys_an_input_or_a_file_it_did_not_write(tmp_path, capsys):
    lengths = tmp_path / "mylen.txt"
    lengths.write_text("100\n200\n")
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    cases = [(["--lengths", str(lengths), "--json", str(lengths)],
              f"--json {lengths} is the input --lengths {lengths}: writing it would destroy"),
             (["--lengths", str(lengths), "--json", str(lengths), "--overwrite"], "the input"),
             (["--json", str(notes)], f"--json {notes} already exists and was not written by "
                                      "dcp-dry-run: add --overwrite to replace it"),
             (["--json", "/proc/version", "--overwrite"], "--json /proc/version: cannot be "
                                                          "written"),
             (["--json", str(tmp_path / "no" / "r.json")], "does not exist (create it first)")]
    for flags, message in cases:
        with pytest.raises(SystemExit):
            parse_args(flags)
        assert message in capsys.readouterr().err, flags
    assert lengths.read_text() == "100\n200\n" and notes.read_text() == '{"mine": 1}'
    # a report dcp-dry-run wrote is its own: replaced without --overwrite
    mine = tmp_path / "dry.json"
    mine.write_text(json.dumps({"written_by": "dcp-dry-run (megatron-dcp)", "ok": True},
                               indent=1))
    assert parse_args(["--json", str(mine)]).json == str(mine)
    assert parse_args(["--json", str(notes), "--overwrite"]).json == str(notes)


def test_the_report_carries_its_mark_and_is_replaced_by_the_next(tmp_path):
    from megatron_dcp.dryrun.__main__ import main

    out = tmp_path / "dry.json"
    flags = ["--gpus", "2", "--layers", "1", "--model", "gpt-1b", "--global-batch-tokens",
             "2048", "--max-len", "1024", "--no-create-groups", "--json", str(out)]
    assert main(flags) == 0
    assert json.loads(out.read_text())["written_by"] == "dcp-dry-run (megatron-dcp)"
    assert main(flags) == 0


def test_gpus_per_node_counts_gpus_and_the_megatron_engine_derives_the_dcp_ranks():
    """Issue 60 item 4 (and 55): --gpus-per-node said "ranks per node" and went to the planner
    as DCP ranks per node, so TP 2 on 8-GPU nodes was planned as 8 DCP ranks a node (4 are)."""
    from megatron_dcp.dryrun.__main__ import dcp_ranks_per_node, parse_args

    megatron = parse_args(["--engine", "megatron", "--gpus", "64", "--gpus-per-node", "8",
                           "--tp", "2", "--sequence-parallel"])
    assert dcp_ranks_per_node(megatron) == 4
    staged = parse_args(["--engine", "megatron", "--gpus", "16", "--gpus-per-node", "8",
                         "--tp", "4", "--pp", "4"])
    assert dcp_ranks_per_node(staged) == 1  # one DCP rank a stage: the world holds 1
    assert dcp_ranks_per_node(parse_args(["--gpus", "16", "--gpus-per-node", "8"])) == 8
    assert dcp_ranks_per_node(parse_args(["--gpus", "16"])) is None
