"""The figures of a step (`megatron_dcp.runtime.figures`): FLOPs per document against a hand
count, the packed-sample formula's overcount, the plan's shape, MFU and the plan's efficiency,
and reading them back from log rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import figures_driver

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan import load_model, make_plan
from megatron_dcp.plan.plan import Plan, Task
from megatron_dcp.runtime.figures import (FIGURES, PREFIX, StepFigures, document_flops,
                                          plan_shape_figures, row_figures, scalars)

DOCS = [100, 1_000, 10_000]


def _llama7b_by_hand(lengths: list[int], *, attention_pairs) -> float:
    """Training FLOPs of llama-7b (32 layers, hidden 4096, 32 heads of 128, SwiGLU FFN 11008,
    vocabulary 32000, untied embeddings) over ``lengths``, written out: 6 x parameters x tokens
    (q, k, v, o: 4 h^2; FFN 3 h f; embedding and head 2 V h) + per layer 4 x h x pairs forward
    (Q K^T and P V), three times for forward and backward."""
    h, n, f, v = 4096, 32, 11008, 32000
    params = n * (4 * h * h + 3 * h * f) + 2 * v * h
    return 6 * params * sum(lengths) + 3 * 4 * h * n * attention_pairs


def test_flops_of_documents_equal_a_hand_count():
    causal_pairs = sum(x * (x + 1) // 2 for x in DOCS)  # each document attends to itself only
    expected = _llama7b_by_hand(DOCS, attention_pairs=causal_pairs)
    assert document_flops(load_model("llama-7b"), DOCS) == pytest.approx(expected, rel=1e-9)


def test_packed_sample_formula_overcounts_attention_between_documents():
    """Megatron-LM's throughput counts a packed sample's attention from its seq_length as if it
    were one document; the document mask computes no pair between documents."""
    shape = load_model("llama-7b")
    packed = document_flops(shape, [sum(DOCS)])  # the 11,100-token sample as one sequence
    per_document = document_flops(shape, DOCS)
    between = sum(a * b for i, a in enumerate(DOCS) for b in DOCS[i + 1:])  # pairs across docs
    assert packed - per_document == pytest.approx(12 * 4096 * 32 * between, rel=1e-9)
    # Megatron-LM's own convention (training.py, num_floating_point_operations: core attention
    # 2 x 3 x h x seq^2 per layer, causal halving folded in) over the packed sample
    megatron_attention_packed = 6 * 4096 * 32 * sum(DOCS) ** 2
    megatron_attention_docs = 6 * 4096 * 32 * sum(x * x for x in DOCS)
    assert megatron_attention_packed - megatron_attention_docs == 12 * 4096 * 32 * between
    attention = 12 * 4096 * 32 * sum(x * (x + 1) // 2 for x in DOCS)
    assert (packed - per_document) / attention > 0.2  # attention counted 22 % too high
    assert packed / per_document > 1.03  # the step's FLOPs (and MFU) 3 % too high at 7B


def test_flops_of_a_tensor_parallel_model_are_the_whole_models():
    shape = load_model("llama-7b")
    from dataclasses import replace

    assert document_flops(replace(shape, tensor_parallel=4), DOCS) == \
        pytest.approx(document_flops(shape, DOCS), rel=1e-12)


def _task(i, ranks, seqs, *, ulysses=1, ring=1, recompute=0, start=0.0, duration=1.0, **kw):
    return Task(id=i, ranks=ranks, seqs=seqs, ulysses=ulysses, ring=ring,
                recompute_layers=recompute, start=start, duration=duration, **kw)


def test_plan_shape_figures_of_a_hand_made_plan():
    lengths = (4000, 3000, 100, 200, 300)
    plan = Plan(tasks=(
        _task(0, (0, 1), (0,), ulysses=2, recompute=2, duration=2.0),
        _task(1, (2, 3), (1,), ring=2, duration=1.5),
        _task(2, (2,), (2, 3), start=1.5, duration=0.5),
        _task(3, (3,), (4,), start=1.5, duration=0.25, mlp_tiles=2),
    ), lengths=lengths, world_size=4)
    fig = plan_shape_figures(plan)
    assert fig["tokens_degree_2"] == 7000 and fig["tokens_degree_1"] == 600
    assert (fig["tasks_single"], fig["tasks_ulysses"], fig["tasks_ring"],
            fig["tasks_hybrid"]) == (2, 1, 1, 0)
    assert fig["recompute_layers_mean"] == 0.5 and fig["recompute_layers_max"] == 2
    assert (fig["micro_steps_min"], fig["micro_steps_max"]) == (1, 2)
    busy = 2 * 2.0 + 2 * 1.5 + 0.5 + 0.25
    assert fig["idle_share"] == pytest.approx(1 - busy / (4 * 2.0))
    assert fig["tasks_tiled"] == 1 and fig["offload_layers_max"] == 0


def test_plain_data_parallel_has_no_idle_share_and_no_long_choices():
    from megatron_dcp.runtime.step import data_parallel_plan

    fig = plan_shape_figures(data_parallel_plan([10, 20, 30], 2))
    assert "idle_share" not in fig and "tasks_tiled" not in fig
    assert (fig["micro_steps_min"], fig["micro_steps_max"], fig["tokens_degree_1"]) == (1, 2, 60)


def _driver(config, shape, hardware="h100", world=8):
    return figures_driver(config, shape, hardware)


def _result(plan, *, wall_s, predicted_s=0.0, skipped=False, tokens=None):
    """A step result of ``plan``; ``tokens`` trained (default: every next-token target)."""
    tokens = plan.target_tokens if tokens is None else tokens
    return SimpleNamespace(plan=plan, loss=2.5, grad_norm=1.25, wall_s=wall_s, skipped=skipped,
                           predicted_s=predicted_s, calibration_error=0.1, plan_s=0.02,
                           plan_wait_s=0.005, tokens=tokens)


def test_step_figures_mfu_efficiency_and_skipped_steps():
    shape = load_model("llama-7b")
    config = DCPConfig(enabled=True, hardware="h100")
    lengths = [100, 1000, 10000, 30000, 500, 2000, 700, 4000]
    plan = make_plan(lengths, world_size=8, model=shape, config=config, hardware="h100")
    figures = StepFigures(_driver(config, shape))
    predicted = plan.makespan + 0.05
    trained = 12345  # a loss mask trains fewer tokens than the step runs
    result = _result(plan, wall_s=2 * predicted, predicted_s=predicted, tokens=trained)
    fig = figures(result)
    assert set(fig) - set(FIGURES) <= {k for k in fig if k.startswith("tokens_degree_")}
    assert fig["tokens"] == trained and fig["tokens_per_s"] == trained / (2 * predicted)
    assert fig["tokens_run"] == sum(lengths)
    assert fig["tokens_run_per_s"] == sum(lengths) / (2 * predicted)
    assert fig["model_tflop"] == pytest.approx(document_flops(shape, lengths) / 1e12)
    assert fig["tflops_per_gpu"] == pytest.approx(fig["model_tflop"] / (2 * predicted) / 8)
    assert fig["mfu"] == pytest.approx(fig["tflops_per_gpu"] * 1e12 / 9.89e14)
    assert fig["prediction_error"] == pytest.approx(-0.5)
    from megatron_dcp.plan import build_cost_model, simulate

    cost = build_cost_model(shape, config, 8, "h100", 1)
    assert fig["plan_efficiency"] == pytest.approx(simulate(plan, cost).efficiency, rel=1e-12)
    assert 0.5 < fig["plan_efficiency"] <= 1.0
    assert fig["plan_ms"] == pytest.approx(20) and fig["plan_wait_ms"] == pytest.approx(5)
    assert figures(result) is fig  # asked twice (log and dashboard): computed once
    skipped = figures(_result(plan, wall_s=1.0, predicted_s=predicted, skipped=True))
    assert skipped["skipped"] == 1 and skipped["skipped_steps"] == 1 and skipped["tokens"] == 0
    assert skipped["tokens_run"] == sum(lengths)  # it ran (and cost) them all the same
    assert fig["skipped_steps"] == 0


def test_step_figures_without_dcp_or_hardware():
    """Plain data parallel: no prediction; no hardware known: FLOPs without MFU."""
    shape = load_model("llama-7b")
    from megatron_dcp.runtime.step import data_parallel_plan

    figures = StepFigures(_driver(DCPConfig(enabled=False), shape, hardware=None, world=2))
    fig = figures(_result(data_parallel_plan([100, 200], 2), wall_s=1.0))
    assert "predicted_s" not in fig and "mfu" not in fig and "plan_efficiency" not in fig
    assert fig["tflops_per_gpu"] == pytest.approx(document_flops(shape, [100, 200]) / 2e12)


def test_row_figures_of_new_and_older_rows():
    new = {"iteration": 3, "loss": 9.0, "figures": {"loss": 2.0, "mfu": 0.4}}
    assert row_figures(new) == {"loss": 2.0, "mfu": 0.4}
    old = {"iteration": 3, "loss": 2.0, "tokens": 10, "tokens_per_s": 5.0, "step_s": 2.0,
           "skipped": False, "skipped_steps": 0, "skipped_sequences": 0, "grad_norm": None,
           "plan": {"mode": "dcp", "degrees": {"1": 3, "2": 1}, "micro_steps_per_rank": [3, 1],
                    "recompute_layers": [0, 2], "predicted_s": 1.5, "plan_ms": 4.0}}
    fig = row_figures(old)
    assert fig["tasks_degree_2"] == 1 and fig["micro_steps_max"] == 3
    assert fig["recompute_layers_max"] == 2 and fig["predicted_s"] == 1.5
    assert "grad_norm" not in fig and fig["skipped"] == 0
    launcher = {"iteration": 1, "loss": 2.0, "tokens": 10, "sequences": 2,
                "plan": {"mode": "data-parallel", "micro_steps_per_rank": None}}
    assert row_figures(launcher) == {"loss": 2.0, "tokens": 10, "sequences": 2}


def test_scalars_carry_the_prefix_and_the_step():
    assert scalars({"mfu": 0.5, "loss": 2}, 7) == [(PREFIX + "loss", 2.0, 7),
                                                    (PREFIX + "mfu", 0.5, 7)]


def test_every_figure_is_documented():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "MONITORING.md").read_text()
    names = [name.replace("_D", "_") for name in FIGURES]
    assert [n for n in names if f"`{n}" not in text] == []


def test_the_iteration_line_shows_the_mfu(capsys):
    from megatron_dcp.runtime.report import TrainingLog

    log = TrainingLog("dcp", 2)
    log.iteration(1, loss=2.0, tokens=100, step_s=0.5, plan={"mode": "data-parallel",
                  "micro_steps_per_rank": [1]}, figures={"mfu": 0.4132})
    log.iteration(2, loss=2.0, tokens=100, step_s=0.5, plan={"mode": "data-parallel",
                  "micro_steps_per_rank": [1]})
    first, second = capsys.readouterr().out.splitlines()
    assert "200 tok/s MFU 41.3% step 500 ms" in first and "200 tok/s step 500 ms" in second


def test_plan_efficiency_stays_within_its_time_budget(monkeypatch):
    """Its lower bound costs about the planner's time: with no budget left after the first
    step, the next steps go without it (a thousand ranks would otherwise pay seconds a step)."""
    import megatron_dcp.runtime.figures as figures_module

    shape, config = load_model("llama-7b"), DCPConfig(enabled=True, hardware="h100")
    plan = make_plan([100, 1000, 10000, 30000], world_size=8, model=shape, config=config,
                     hardware="h100")
    monkeypatch.setattr(figures_module, "EFFICIENCY_FREE_S", 0.0)
    monkeypatch.setattr(figures_module, "EFFICIENCY_SHARE", 0.0)
    figures = StepFigures(_driver(config, shape))
    steps = [figures(_result(plan, wall_s=1.0, predicted_s=1.0)) for _ in range(3)]
    assert ["plan_efficiency" in f for f in steps] == [True, False, False]
    monkeypatch.setattr(figures_module, "EFFICIENCY_SHARE", 1.0)  # a budget of the whole step
    assert "plan_efficiency" in figures(_result(plan, wall_s=1.0, predicted_s=1.0))
