"""Property tests: random workloads, world sizes 1-1024, budgets and model shapes give valid,
deterministic plans, and ``dcp`` is never slower in the simulator than any baseline."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan import PlanError, build_cost_model, make_plan, simulate, validate_plan
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.presets import MODEL_PRESETS
from megatron_dcp.plan.vocabulary import Vocabulary

BASELINES = ("bucket", "packed", "static", "greedy-cp")
FAST = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@st.composite
def shapes(draw):
    if draw(st.booleans()):
        return MODEL_PRESETS[draw(st.sampled_from(["gpt-1b", "llama-7b", "video-dit"]))]
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 3, 5]))
    head_dim = draw(st.sampled_from([16, 64, 128]))
    return ModelShape(num_layers=draw(st.integers(1, 48)), hidden_size=heads * head_dim,
                      num_heads=heads, ffn_hidden_size=draw(st.integers(64, 8192)),
                      vocab_size=draw(st.integers(100, 64000)), num_kv_heads=kv,
                      gated_mlp=draw(st.booleans()), causal=draw(st.booleans()))


@st.composite
def cases(draw):
    world = draw(st.one_of(st.integers(1, 16), st.sampled_from([24, 32, 48, 64, 128, 256, 1024])))
    per_node = draw(st.sampled_from([1, 2, 4, 8]))
    max_seqs = max(1, min(60, 20_000 // world))
    lengths = draw(st.lists(st.one_of(st.integers(1, 4096), st.integers(4096, 200_000)),
                            min_size=1, max_size=max_seqs))
    config = DCPConfig(ranks_per_node=per_node,
                       memory_budget_gb=draw(st.sampled_from([None, 40.0, 80.0, 200.0])),
                       recompute=draw(st.sampled_from(["auto", "auto", "full", "none"])),
                       oversize=draw(st.sampled_from(["skip", "truncate"])),
                       hardware=draw(st.sampled_from(["h200", "h100", "a100"])))
    return world, lengths, config, draw(shapes())


@FAST
@given(cases())
def test_random_inputs_give_valid_deterministic_plans(case):
    world, lengths, config, model = case
    try:
        cm = build_cost_model(model, config, world, zero_stage=3)
    except PlanError as err:
        assert "below the static memory" in str(err)
        event("budget below static memory")
        return
    event("planned")
    vocab = Vocabulary(world, cm.ranks_per_node, config.max_degree)
    plans = {}
    for policy in ("dcp",) + BASELINES:
        plan = make_plan(lengths, world_size=world, model=model,
                         config=config.replace(policy=policy),
                         zero_stage=3)
        validate_plan(plan, model, cost_model=cm, vocabulary=vocab)
        again = make_plan(lengths, world_size=world, model=model,
                          config=config.replace(policy=policy),
                          zero_stage=3)
        assert plan.digest() == again.digest()
        plans[policy] = plan
    if not plans["dcp"].tasks:
        return
    results = {name: simulate(plan, cm) for name, plan in plans.items()}
    for name in BASELINES:
        assert results["dcp"].step_time_s <= results[name].step_time_s * (1 + 1e-9), name
    for result in results.values():  # the bounds are bounds
        assert result.efficiency <= result.moldable_efficiency <= 1 + 1e-9


@FAST
@given(st.lists(st.integers(1, 300_000), min_size=1, max_size=40), st.integers(1, 64))
def test_dcp_ablations_are_valid_and_dcp_is_not_slower(lengths, world):
    config = DCPConfig(oversize="skip")
    model = MODEL_PRESETS["llama-7b"]
    cm = build_cost_model(model, config, world)
    times = {}
    for policy in ("dcp", "dcp-inter", "dcp-intra", "bucket"):
        plan = make_plan(lengths, world_size=world, model=model,
                         config=config.replace(policy=policy))
        validate_plan(plan, model, cost_model=cm)
        times[policy] = simulate(plan, cm, bound=0.0).step_time_s
    assert times["dcp"] <= times["bucket"] * (1 + 1e-9)
    assert times["dcp-intra"] <= times["bucket"] * (1 + 1e-9)


@pytest.mark.parametrize("world", [1, 3, 1024])
def test_edge_worlds(world):
    model = MODEL_PRESETS["llama-7b"]
    plan = make_plan([7, 20_000, 1], world_size=world, model=model, config=DCPConfig())
    validate_plan(plan, model)
