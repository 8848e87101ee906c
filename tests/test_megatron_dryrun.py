"""The dry run's Megatron path (issue 43): megatron-core's GPTModel through DCPForwardBackward on
the meta device under torch's fake process group, every rank in this process: TP with sequence
parallelism and the distributed optimizer, pipelines (plain and interleaved), MoE with expert
parallelism, and a rank over its memory budget. In a file of its own so that both
megatron-core legs (0.16 and 0.19) run it."""

from __future__ import annotations

import pytest

from megatron_dcp.dryrun.__main__ import parse_args, print_table, run


def _run(*flags: str, **controls):
    return run(parse_args(["--gpus", "16", "--layers", "1", "--global-batch-tokens", "65536",
                           *flags]), **controls)


def test_megatron_path_sixteen_ranks_tp2_sequence_parallel_distributed_optimizer():
    """Megatron-core's GPTModel (DCP's layer spec, Megatron's DDP with the distributed
    optimizer) through DCPForwardBackward at Llama-7B width: every rank of 16 (TP 2 x DCP 8)
    issues the same collectives as its groups' other members, no host tensor reaches one, and
    the TP groups' sequence-parallel collectives are among them."""
    pytest.importorskip("megatron.core")
    report = _run("--engine", "megatron", "--tp", "2", "--sequence-parallel",
                  "--zero-stage", "1")
    assert report["ok"] and report["consistent"], report["mismatches"][:2]
    for r in report["ranks"]:
        assert r["error"] == "" and r["cpu_tensors"] == 0 and r["predicted_bytes"]
    with_tp_peer = run(parse_args(["--engine", "megatron", "--gpus", "4", "--tp", "2",
                                   "--sequence-parallel", "--layers", "1",
                                   "--global-batch-tokens", "16384"]), keep_calls=True)
    groups = {c.group for c in with_tp_peer["calls"][0]}
    assert (0, 1) in groups and (0, 2) in groups  # a TP pair, and the DCP world {0, 2}


@pytest.mark.slow  # in-process, but 10-25 s: out of the fast tier
def test_megatron_pipeline_tp2_pp2_sends_meet_their_receives():
    """8 ranks = TP 2 x PP 2 x DCP 2: Megatron's 1F1B schedule under DCP (lockstep slots), its
    P2P activations and gradients matched send to receive in order (the receive's shape from
    the plan, `SlotShapes`; the send's from the tensor sent: a wrong shape or a stage that
    skips a micro-batch is a mismatch)."""
    pytest.importorskip("megatron.core")
    report = run(parse_args(["--engine", "megatron", "--gpus", "8", "--tp", "2", "--pp", "2",
                             "--sequence-parallel", "--layers", "2",
                             "--global-batch-tokens", "32768"]), keep_calls=True)
    assert report["ok"] and report["consistent"], report["mismatches"][:2]
    sends = [c for c in report["calls"][0] if c.op == "send" and c.peer == 4]
    assert any(len(c.shapes[0]) == 3 for c in sends)  # activations to the next stage
    # the shapes a stage receives are known from the plan: no shape message, no host read
    assert not any("pipeline_engine" in site for r in report["ranks"] for site in r["host_syncs"])
    assert all(len(c.shapes[0]) == 3 for c in sends)
    # the prediction is the stage's, through the schedule: 1F1B's first stage holds more
    # micro-batches in flight than its last (rank 0: stage 0; rank 4: stage 1; one DCP rank)
    predicted = {r["rank"]: r["predicted_bytes"] for r in report["ranks"]}
    assert predicted[0] > predicted[4] > 0
    cut = run(parse_args(["--engine", "megatron", "--gpus", "8", "--tp", "2", "--pp", "2",
                          "--sequence-parallel", "--layers", "2",
                          "--global-batch-tokens", "32768"]),
              drop_call=(4, [c.op for c in report["calls"][4]].index("recv_")))
    assert not cut["consistent"]


@pytest.mark.slow  # in-process, but 10-25 s: out of the fast tier
def test_megatron_interleaved_pipeline_sends_meet_their_receives():
    """8 ranks = TP 2 x PP 2 x DCP 2 with 2 virtual stages a rank: Megatron's interleaved
    schedule, its received shapes from the plan (`SlotShapes.interleaved`: the schedule table's
    order; the exchange sent them and read them on the host, which meta cannot), every send
    matched with its receive; a dropped receive is a mismatch."""
    pytest.importorskip("megatron.core")
    flags = ["--engine", "megatron", "--gpus", "8", "--tp", "2", "--pp", "2", "--vpp", "2",
             "--sequence-parallel", "--layers", "4", "--global-batch-tokens", "32768"]
    report = run(parse_args(flags), keep_calls=True)
    assert report["ok"] and report["consistent"], report["mismatches"][:2]
    assert not any("pipeline_engine" in site for r in report["ranks"] for site in r["host_syncs"])
    assert all(r["error"] == "" for r in report["ranks"])
    cut = run(parse_args(flags),
              drop_call=(4, [c.op for c in report["calls"][4]].index("recv_")))
    assert not cut["consistent"]


def test_megatron_path_refuses_what_it_cannot_run_yet():
    with pytest.raises(ValueError, match="leading dense layers"):
        _run("--engine", "megatron", "--model", "deepseek-v3", "--layers", "4", "--ranks", "0")
    with pytest.raises(ValueError, match="MoE models need --engine megatron"):
        _run("--model", "mixtral-8x7b", "--ranks", "0")
    with pytest.raises(ValueError, match="dense model"):
        _run("--engine", "megatron", "--ep", "2", "--ranks", "0")


@pytest.mark.slow  # in-process, but 10-25 s: out of the fast tier
def test_megatron_moe_expert_parallel_all_to_alls_line_up():
    """Qwen3-30B-A3B's MoE layer (128 experts, top-8) with EP 4 on 4 ranks: Megatron's alltoall
    dispatcher under DCP's lockstep slots (balanced routing: `megatron_dcp.dryrun.moe_routing`),
    every expert group's dispatch and combine all-to-alls issued by all its members in the same
    order (their rows differ: each sends its own tokens); a rank that drops one is named."""
    pytest.importorskip("megatron.core")
    flags = ["--engine", "megatron", "--gpus", "4", "--model", "qwen3-30b-a3b", "--ep", "4",
             "--layers", "1", "--global-batch-tokens", "16384"]
    report = run(parse_args(flags), keep_calls=True)
    assert report["ok"] and report["consistent"], report["mismatches"][:2]
    moe = [c for c in report["calls"][1] if c.op.startswith("alltoall_base") and c.split]
    assert moe and {c.group for c in moe} == {(0, 1, 2, 3)}
    for r in report["ranks"]:
        assert r["error"] == "" and r["cpu_tensors"] == 0
        assert 0.9 < r["peak_bytes"] / r["predicted_bytes"] < 1.25, r
    first = next(i for i, c in enumerate(report["calls"][1]) if c.split)
    cut = run(parse_args(flags), drop_call=(1, first))
    assert not cut["consistent"] and any(m.get("group") == [0, 1, 2, 3]
                                         for m in cut["mismatches"])


@pytest.mark.slow  # in-process, but 10-25 s: out of the fast tier
def test_megatron_moe_expert_tp1_groups_inside_tp_pairs_plan_free():
    """TP 2 with expert TP 1 and EP 2: each expert group is a TP pair of one DCP rank (free
    plans), its all-to-alls on that pair."""
    pytest.importorskip("megatron.core")
    report = run(parse_args(["--engine", "megatron", "--gpus", "4", "--model", "qwen3-30b-a3b",
                             "--tp", "2", "--sequence-parallel", "--ep", "2", "--expert-tp", "1",
                             "--layers", "1", "--global-batch-tokens", "16384"]),
                 keep_calls=True)
    assert report["ok"] and report["consistent"], report["mismatches"][:2]
    moe = {c.group for c in report["calls"][2] if c.split}
    assert moe == {(2, 3)}


def test_a_rank_over_its_memory_budget_fails_the_run_and_is_named(capsys, tmp_path):
    """A model planned as Transformer Engine's layer (its row, counted: about 60 % of what
    Megatron's local layer keeps) and run as the local layer, the only one a CPU builds: 13 GiB
    a rank, the plan fits by the model, the measured activations do not; the run fails and
    names the ranks. (Before the planner learned the local layer, its own plan was over.)"""
    pytest.importorskip("megatron.core")
    import dataclasses
    import json

    from megatron_dcp.plan import load_model

    shape = tmp_path / "te.json"
    shape.write_text(json.dumps(dataclasses.replace(
        load_model("llama-7b"), layer_memory="transformer-engine").to_dict()))
    args = parse_args(["--engine", "megatron", "--gpus", "4", "--tp", "2", "--sequence-parallel",
                       "--layers", "1", "--global-batch-tokens", "65536",
                       "--memory-budget-gb", "13", "--model", str(shape)])
    report = run(args)
    for r in report["ranks"]:
        assert r["over_budget"] == (r["peak_bytes"] > r["budget_bytes"])
        assert r["predicted_bytes"] <= r["budget_bytes"]  # the plan fits by the model
    assert any(r["over_budget"] for r in report["ranks"]) and not report["ok"]
    print_table(report)
    assert "over the memory budget" in capsys.readouterr().out
