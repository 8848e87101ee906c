"""`megatron_dcp.runtime.report`: the plan summary and the per-iteration output of the examples."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megatron_dcp.plan.plan import Plan, Task
from megatron_dcp.runtime.report import (TrainingLog, plan_summary, plan_timeline, progress_bar,
                                        timeline_tasks)


def _plan() -> Plan:
    tasks = (Task(id=0, ranks=(0, 1), seqs=(0,), ulysses=2, ring=1, recompute_layers=2, start=0.0),
             Task(id=1, ranks=(0,), seqs=(1, 2), ulysses=1, ring=1, recompute_layers=0, start=1.0),
             Task(id=2, ranks=(0,), seqs=(3,), ulysses=1, ring=1, recompute_layers=0, start=2.0))
    return Plan(tasks=tasks, lengths=(40, 5, 7, 3), world_size=3, policy="manual")


def test_plan_summary_of_a_plan_and_of_data_parallel():
    got = plan_summary(_plan(), plan_s=0.0123)
    assert got["mode"] == "dcp"
    assert got["degrees"] == {"1": 2, "2": 1}
    assert got["micro_steps_per_rank"] == [3, 1, 0]  # rank 2 has no task
    assert got["recompute_layers"] == [0, 2]
    assert got["plan_ms"] == 12.3 and got["predicted_s"] == round(_plan().makespan, 6)
    assert "plan_ms" not in plan_summary(_plan())
    assert plan_summary(None, micro_steps=(2, 1)) == {"mode": "data-parallel",
                                                      "micro_steps_per_rank": [2, 1]}
    assert plan_summary(None, micro_steps=4)["micro_steps_per_rank"] == 4


def test_training_log_lines_json_and_final_line(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    log = TrainingLog("dcp", 2, json_path=str(path))
    rec = log.iteration(1, loss=2.5, tokens=100, step_s=0.5, plan=plan_summary(_plan()),
                        grad_norm=1.0)
    log.iteration(2, loss=2.0, tokens=300, step_s=0.5, plan=plan_summary(None, micro_steps=1))
    log.close()
    assert rec["tokens_per_s"] == 200.0 and rec["grad_norm"] == 1.0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert {"iteration", "loss", "tokens", "tokens_per_s", "step_s", "plan"} <= set(records[0])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(progress_bar(1, 2) + " iter 1/2 loss 2.5000 tokens 100 200 tok/s")
    assert "| tasks 2 at SP 1, 1 at SP 2 | micro-steps/rank 3/1/0 | recompute 0-2 layers" \
        in out[0]
    assert out[1].endswith("| micro-steps/rank 1")
    assert out[2] == "done: dcp, 2 iterations, 400 tokens trained, 400 tokens/s"
    # a resumed run appends; a non-primary rank writes and prints nothing
    TrainingLog("dcp", 3, json_path=str(path), resume_at=2).iteration(
        3, loss=1.0, tokens=1, step_s=1.0, plan={"mode": "data-parallel",
                                                 "micro_steps_per_rank": 1})
    quiet = TrainingLog("dcp", 3, json_path=str(tmp_path / "other.jsonl"), primary=False)
    quiet.iteration(1, loss=1.0, tokens=1, step_s=1.0, plan=plan_summary(None, micro_steps=1))
    quiet.close()
    assert len(path.read_text().splitlines()) == 3
    assert not (tmp_path / "other.jsonl").exists()
    assert progress_bar(0, 4, width=4) == "[....]" and progress_bar(4, 4, width=4) == "[####]"


def test_lockstep_summary_counts_slots_and_peak_memory_is_measured():
    from dataclasses import replace

    from megatron_dcp.runtime.report import peak_memory_mb, reset_peak_memory

    plan = _plan()
    slotted = replace(plan, tasks=tuple(replace(t, slot=k) for k, t in enumerate(plan.tasks)))
    assert plan_summary(slotted)["slots"] == 3 and "slots" not in plan_summary(plan)
    block = bytearray(256 * 2**20)  # touch 256 MiB: the peak RSS grows by it
    block[:: 4096] = b"\x01" * len(block[:: 4096])
    high = peak_memory_mb()
    del block
    reset_peak_memory()
    if os.path.exists("/proc/self/clear_refs"):  # Linux resets the peak RSS
        assert peak_memory_mb() < high - 200  # measured from the reset, not since the start


def test_tokens_trained_and_run_apart_in_rows_and_lines(tmp_path, capsys):
    """Issue 57 item 4: a loss mask trains fewer tokens than the step runs. A row's ``tokens``
    and ``tokens_per_s`` are the trained ones, ``tokens_run`` and ``tokens_run_per_s`` the run
    ones (given, or the step plan's lengths); the lines say which is which."""
    from megatron_dcp.plan.plan import Plan, Task

    plan = Plan(tasks=(Task(id=0, ranks=(0,), seqs=(0, 1), start=0.0),), lengths=(300, 700),
                world_size=1, policy="dcp")
    path = tmp_path / "log.jsonl"
    log = TrainingLog("dcp", 2, json_path=str(path))
    log.iteration(1, loss=2.0, tokens=250, step_s=2.0, plan=plan_summary(plan), step_plan=plan)
    log.iteration(2, loss=2.0, tokens=50, tokens_run=400, step_s=2.0,
                  plan=plan_summary(None, micro_steps=1))
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["tokens"], r["tokens_run"]) for r in rows] == [(250, 1000), (50, 400)]
    assert [(r["tokens_per_s"], r["tokens_run_per_s"]) for r in rows] == [(125, 500), (25, 200)]
    out = capsys.readouterr().out.splitlines()
    assert " tokens 250 trained/1000 run 125 tok/s trained " in out[0]
    assert out[2] == "done: dcp, 2 iterations, 300 tokens trained (1400 run), 75 tokens/s trained"


def test_a_step_whose_targets_are_all_masked_is_skipped_as_empty(capsys):
    """A loss mask over the whole batch: the plan has targets, none of non-zero weight; the
    driver skips the step (`trains_nothing`) and the line says why, not "non-finite"."""
    from megatron_dcp.plan.plan import Plan, Task

    plan = Plan(tasks=(Task(id=0, ranks=(0,), seqs=(0,), start=0.0),), lengths=(50,),
                world_size=1, policy="dcp")
    log = TrainingLog("dcp", 2)
    log.iteration(1, loss=0.0, tokens=0, step_s=1.0, skipped=True, plan=plan_summary(plan),
                  step_plan=plan)
    log.iteration(2, loss=float("nan"), tokens=49, step_s=1.0, skipped=True,
                  plan=plan_summary(plan), step_plan=plan)
    out = capsys.readouterr().out.splitlines()
    assert "SKIPPED step (no trained token; 1 so far)" in out[0]
    assert "SKIPPED step (non-finite; 2 so far)" in out[1]


def test_skipped_steps_and_sequences_are_counted_and_train_no_tokens(tmp_path, capsys):
    """Issue 22: a skipped step (non-finite) and oversize-skipped sequences are shown and
    counted; tokens and tokens/s cover trained tokens only."""
    from megatron_dcp.plan.plan import Plan, Task
    from megatron_dcp.runtime.report import tokens_run

    plan = Plan(tasks=(Task(id=0, ranks=(0,), seqs=(0,), start=0.0),), lengths=(100, 900),
                world_size=1, policy="dcp", skipped=(1,))
    assert tokens_run(plan, [100, 900]) == (100, 1)
    assert tokens_run(None, [100, 900]) == (1000, 0)
    path = tmp_path / "log.jsonl"
    log = TrainingLog("dcp", 2, json_path=str(path))
    log.iteration(1, loss=2.0, tokens=100, step_s=1.0, plan={"mode": "x", "micro_steps_per_rank":
                                                            1}, skipped_sequences=1, sequences=2)
    log.iteration(2, loss=float("nan"), tokens=100, step_s=1.0, skipped=True,
                  plan=plan_summary(None, micro_steps=1), sequences=2)
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["skipped_sequences"] for r in records] == [1, 0]
    # issue 31: sequences counted as tokens are, the trained ones (the batch's beside them)
    assert [(r["sequences"], r["batch_sequences"]) for r in records] == [(1, 2), (0, 2)]
    assert [(r["skipped"], r["skipped_steps"], r["tokens"]) for r in records] == \
        [(False, 0, 100), (True, 1, 0)]
    out = capsys.readouterr().out.splitlines()
    assert "1 sequences skipped (oversize)" in out[0] and "SKIPPED step" in out[1]
    assert out[2] == ("done: dcp, 2 iterations, 100 tokens trained, 50 tokens/s, 1 steps "
                      "skipped, 1 sequences skipped")


def test_truncated_tokens_and_empty_steps_are_counted_in_the_rows(tmp_path, capsys):
    """Issue 59: the plan of ``oversize="truncate"`` records the sequence it cut; the rows count
    the truncated sequences and tokens; a step with no trained token says so."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import make_plan
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.plan import load_model

    shape = dataclasses.replace(load_model("llama-7b"), max_position=64)
    plan = make_plan([70, 20], world_size=2, model=shape,
                     config=DCPConfig(enabled=True, oversize="truncate"))
    assert plan.lengths == (64, 20) and plan.truncated == {0: 70} and plan.truncated_tokens == 6
    assert Plan.from_dict(plan.to_dict()).truncated == {0: 70}  # kept in the JSON's meta
    empty = Plan(tasks=(), lengths=(70,), world_size=1, skipped=(0,))
    path = tmp_path / "log.jsonl"
    log = TrainingLog("dcp", 2, json_path=str(path))
    log.iteration(1, loss=2.0, tokens=84, step_s=1.0, plan=plan_summary(plan), step_plan=plan)
    log.iteration(2, loss=float("nan"), tokens=0, step_s=1.0, skipped=True,
                  plan=plan_summary(empty),
                  skipped_sequences=1, step_plan=empty)
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["truncated_sequences"], r["truncated_tokens"]) for r in records] == \
        [(1, 6), (0, 0)]
    out = capsys.readouterr().out.splitlines()
    assert "1 sequences truncated (6 tokens cut, oversize)" in out[0]
    assert "SKIPPED step (no trained token; 1 so far)" in out[1]
    assert out[2].endswith("1 steps skipped, 1 sequences skipped, 6 tokens truncated")


def test_resuming_past_train_iters_exits_non_zero_saying_so(capsys):
    """Issue 22: ``--train-iters 3`` with a checkpoint at 6 printed ``done: 0 iterations``,
    exit 0."""
    import pytest

    from megatron_dcp.runtime.report import check_resume_point

    with pytest.raises(SystemExit, match="at iteration 6, past --train-iters 3") as exit_:
        check_resume_point(6, 3, "ckpt", primary=True)
    assert exit_.value.code != 0
    check_resume_point(3, 3, "ckpt", primary=True)  # complete: said, not an error
    assert "already complete" in capsys.readouterr().out
    check_resume_point(2, 3, "ckpt", primary=True)


def _planned(iteration: int):
    """A DCP plan of gpt-1b on 8 H100 ranks (some groups of several ranks)."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import load_model, make_plan

    lengths = [64 * ((iteration * 37 + 11 * k) % 400 + 1) for k in range(24)]
    return make_plan(lengths, world_size=8, model=load_model("gpt-1b"),
                     config=DCPConfig(enabled=True, hardware="h100"), hardware="h100",
                     iteration=iteration)


def test_rows_carry_the_timeline_at_the_first_iteration_and_every_nth(tmp_path):
    path = tmp_path / "log.jsonl"
    log = TrainingLog("dcp", 12, json_path=str(path), quiet=True, timeline_interval=5)
    for it in range(3, 13):  # a resumed run: its first row is iteration 3
        log.iteration(it, loss=1.0, tokens=1, step_s=1.0, plan=plan_summary(_plan()),
                      step_plan=_plan())
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in rows if "timeline" in r] == [3, 5, 10]
    never = TrainingLog("dcp", 2, quiet=True, timeline_interval=0)
    assert "timeline" not in never.iteration(1, loss=1.0, tokens=1, step_s=1.0,
                                             plan=plan_summary(_plan()), step_plan=_plan())
    plain = TrainingLog("data-parallel", 2, quiet=True)  # no DCP plan: no timeline
    assert "timeline" not in plain.iteration(1, loss=1.0, tokens=1, step_s=1.0,
                                             plan=plan_summary(None, micro_steps=1))


def test_the_timeline_is_the_plans_tasks_at_their_predicted_times():
    plan = _planned(3)
    assert any(t.degree > 1 for t in plan.tasks) and len({t.start for t in plan.tasks}) > 1
    row = TrainingLog("dcp", 1, quiet=True).iteration(
        1, loss=1.0, tokens=1, step_s=1.0, plan=plan_summary(plan), step_plan=plan)
    timeline = json.loads(json.dumps(row["timeline"]))  # as the log holds it
    assert timeline["world_size"] == 8
    got = timeline_tasks(timeline)
    assert [(t[2], t[3], t[4]) for t in got] == [(t.degree, t.recompute_layers, t.ranks)
                                                 for t in plan.tasks]
    for (start, duration, *_), task in zip(got, plan.tasks):
        assert start == pytest.approx(task.start, abs=1e-6)
        assert duration == pytest.approx(task.duration, abs=1e-6)
    # the times predicted_s is made of: the plan's makespan
    assert max(s + d for s, d, *_ in got) == pytest.approx(row["plan"]["predicted_s"], abs=2e-6)


def test_a_group_of_ranks_out_of_order_is_written_as_a_list():
    tasks = (Task(id=0, ranks=(2, 3), seqs=(0,), ulysses=2, duration=0.5),
             Task(id=1, ranks=(1, 0), seqs=(1,), ulysses=2, duration=0.25))
    plan = Plan(tasks=tasks, lengths=(8, 8), world_size=4, policy="manual")
    assert plan_timeline(plan)["tasks"] == [[0.0, 0.5, 2, 0, 2], [0.0, 0.25, 2, 0, [1, 0]]]
    assert [t[4] for t in timeline_tasks(plan_timeline(plan))] == [(2, 3), (1, 0)]


def test_plan_text_says_the_plan_in_words():
    """Issue 60 item 5: a raw dict of degrees and a list of recompute depths were unexplained;
    a 64-rank list of micro-steps filled the line."""
    from types import SimpleNamespace

    from megatron_dcp.runtime.report import plan_line, plan_text

    many = {"mode": "dcp", "degrees": {"1": 60, "4": 2}, "micro_steps_per_rank": [3] * 60 + [5],
            "recompute_layers": [0]}
    assert plan_text(many) == "tasks 60 at SP 1, 2 at SP 4 | micro-steps/rank 3-5 | no recompute"
    one = dict(many, recompute_layers=[2], micro_steps_per_rank=[1, 2])
    assert plan_text(one).endswith("micro-steps/rank 1/2 | recompute 2 layers")
    assert plan_text({"mode": "data-parallel", "micro_steps_per_rank": 4}) == \
        "micro-steps/rank 4"
    result = SimpleNamespace(plan=_plan(), micro_steps=3, skipped=False, predicted_s=0.315,
                             calibration_error=0.08)
    assert plan_line(3, result, 0.506) == (
        "[dcp] iteration 3: step 506 ms, predicted 315 ms (median error 8%) | tasks 2 at SP 1, "
        "1 at SP 2 | micro-steps/rank 3/1/0 | recompute 0-2 layers")


def test_the_setup_line_says_lockstep_under_pipeline_stages():
    """Issue 60 item 4: the start-up line said "schedule free" with pipeline stages, whose
    plans are lockstep slots (`make_plan`), as the docs say."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import build_cost_model, load_model
    from megatron_dcp.runtime.report import setup_line

    config = DCPConfig(enabled=True, hardware="h100", memory_budget_gb=80.0)
    cost_model = build_cost_model(load_model("llama-7b"), config, 8)
    assert "schedule free," in setup_line(config, cost_model, 8)
    line = setup_line(config, cost_model, 8, pipelined=True)
    assert "schedule lockstep (pipeline stages)," in line
