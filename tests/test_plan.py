"""Planning layer: presets, hardware, workloads, cost model, vocabulary, planners, validation."""

import json
import math
import re
from dataclasses import replace

import pytest

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan import (CostModel, Hardware, PlanError, build_cost_model, load_hardware,
                               load_model, lower_bound, make_plan, simulate, validate_plan)
from megatron_dcp.plan.hardware import HardwareError
from megatron_dcp.plan.plan import Plan, Task
from megatron_dcp.plan.presets import ModelPresetError
from megatron_dcp.plan.vocabulary import Communicators, Vocabulary
from megatron_dcp.plan.idx_format import write_lengths
from megatron_dcp.plan.workload import (WorkloadError, read_idx_lengths, read_lengths_file,
                                        sample_lengths, validate_lengths, video_lengths)

LLAMA = load_model("llama-7b")
POLICIES = ("dcp", "dcp-inter", "dcp-intra", "bucket", "packed", "static", "greedy-cp")


def plan_for(lengths, world=8, policy="dcp", model=LLAMA, **config):
    config = DCPConfig(policy=policy, **config)
    return make_plan(lengths, world_size=world, model=model, config=config)


# ---------------------------------------------------------------------------- presets and hardware
def test_model_presets():
    assert (LLAMA.num_layers, LLAMA.hidden_size, LLAMA.num_heads, LLAMA.ffn_hidden_size,
            LLAMA.vocab_size) == (32, 4096, 32, 11008, 32000)
    assert load_model("llama-70b").kv_heads == 8
    dit = load_model("video-dit")
    assert dit.frame_tokens and not dit.causal
    for name in ("gpt-1b", "llama-13b"):
        assert load_model(name).name == name
    with pytest.raises(ModelPresetError, match="unknown model 'llama-8b'"):
        load_model("llama-8b")


@pytest.mark.parametrize("name,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55),
                                           ("qwen2.5-7b", 7.62), ("qwen3-8b", 8.19)])
def test_model_presets_match_published_parameter_counts(name, billions):
    """The shipped presets hold the parameters their model cards give (norms left out: under
    0.01 B): a wrong width, head count or vocabulary moves the count by far more than 0.5 %."""
    from megatron_dcp.plan.geometry import Geometry

    geometry = Geometry(load_model(name), load_hardware("h100"), world_size=8)
    assert geometry.params / 1e9 == pytest.approx(billions, rel=5e-3)
    assert load_model(name).name == name


def test_model_json(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"base": "llama-7b", "num_layers": 4}))
    assert load_model(str(path)).num_layers == 4
    path.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "num_heads": 4,
                                "ffn_hidden_size": 128, "vocab_size": 100, "num_kv_heads": 2}))
    assert load_model(str(path)).kv_heads == 2
    path.write_text(json.dumps({"num_layers": 2, "hidden": 64}))
    with pytest.raises(ModelPresetError, match="unknown model shape key"):
        load_model(str(path))


def test_hardware_presets_and_profile(tmp_path):
    for name in ("h200", "h100", "a100"):
        hw = load_hardware(name)
        assert hw.linear_flops < hw.peak_flops and hw.inter_bandwidth < hw.intra_bandwidth
    with pytest.raises(HardwareError, match="unknown hardware 'b300'"):
        load_hardware("b300")
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"name": "cpu", "base": "a100", "linear_flops": 1e11,
                                "attention_flops": 5e10, "task_overhead_s": 0.01}))
    hw = load_hardware(str(path))
    assert hw.linear_flops == 1e11 and hw.task_overhead_s == 0.01 and hw.hbm_bytes == 80e9
    assert Hardware(**{k: v for k, v in hw.to_dict().items() if k != "format_version"}) == hw
    path.write_text(json.dumps({"name": "x", "peak_flops": 1e12}))
    with pytest.raises(HardwareError, match="missing field"):
        load_hardware(str(path))
    path.write_text(json.dumps({"base": "h100", "linear_flops": -1}))
    with pytest.raises(HardwareError, match="linear_flops"):
        load_hardware(str(path))
    with pytest.raises(HardwareError, match="does not exist"):
        load_hardware(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("field, value", [
    ("task_overhead_s", float("nan")), ("token_overhead_s", float("inf")),
    ("attention_flops", float("nan")), ("ring_attention_flops", float("-inf")),
    ("intra_latency", float("nan")), ("communicator_bytes", float("nan")),
    ("comm_overlap", float("nan")), ("hbm_bytes", 0), ("communicator_bytes", -1.0),
    ("ranks_per_node", True), ("linear_flops", "1e12"),
])
def test_non_finite_or_out_of_range_profile_fields_name_the_field_and_file(tmp_path, field, value):
    # JSON's NaN / Infinity literals load as floats; a NaN overhead once passed validation
    # (NaN < 0 is False) and made the planner spin forever
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"base": "h200", field: value}))
    with pytest.raises(HardwareError, match=rf"bad\.json.*{field}="):
        load_hardware(str(path))
    with pytest.raises(HardwareError, match=field):
        replace(load_hardware("h200"), **{field: value})


@pytest.mark.timeout(20)
def test_planner_loop_cannot_spin_on_non_finite_times():
    from megatron_dcp.plan.drafts import BlockClock

    clock = BlockClock(Vocabulary(4, 4))
    assert clock.peek(2) == (0, 0.0)
    clock.avail = [float("nan")] * 4  # what a NaN task time leaves behind
    with pytest.raises(PlanError, match="no progress.*not a finite number"):
        clock.peek(2)


def test_layout_rates_of_presets_and_old_profiles(tmp_path):
    h200 = load_hardware("h200")
    # presets: ring blocks slower than one flash call, hybrid in between
    assert h200.attention_rate(1, 8) < h200.attention_rate(2, 4) < h200.attention_rate(8, 1)
    assert h200.attention_rate(1, 1) == h200.attention_rate(4, 1) == h200.attention_flops
    # a profile from before the per-layout fields: every layout at its one measured rate,
    # also when it names a base preset (whose ring rate belongs to another local rate)
    path = tmp_path / "old.json"
    old = {k: v for k, v in h200.to_dict().items()
           if k not in ("ring_attention_flops", "hybrid_attention_flops", "communicator_bytes")}
    for data in (dict(old, attention_flops=1e11), {"base": "h200", "attention_flops": 1e11}):
        path.write_text(json.dumps(data))
        hw = load_hardware(str(path))
        assert hw.attention_rate(1, 8) == hw.attention_rate(2, 2) == hw.attention_rate(1, 1) == 1e11
    path.write_text(json.dumps({"base": "h200", "attention_flops": 1e11,
                                "ring_attention_flops": 5e10}))
    assert load_hardware(str(path)).attention_rate(1, 2) == 5e10


# ---------------------------------------------------------------------------- workloads
def test_distributions_are_deterministic_and_exact():
    for dist in ("short", "balanced", "long", "uniform"):
        a = sample_lengths(dist, 500_000, seed=3)
        assert a == sample_lengths(dist, 500_000, seed=3)
        assert sum(a) == 500_000 and min(a) >= 1
    short = sample_lengths("short", 2_000_000)
    long = sample_lengths("long", 2_000_000)
    assert sorted(short)[len(short) // 2] < 4096 < sorted(long)[len(long) // 2]
    with pytest.raises(WorkloadError, match="unknown distribution"):
        sample_lengths("zipf", 10)


def test_lengths_validation(tmp_path):
    assert validate_lengths([1, 2.0, 3]) == [1, 2, 3]
    for bad, msg in (([], "empty"), ([3, 0], "sequence 1 has length 0"), ([2.5], "not an integer"),
                     (["7"], "not an integer"), ([-4], "length -4")):
        with pytest.raises(WorkloadError, match=msg):
            validate_lengths(bad)
    path = tmp_path / "l.txt"
    path.write_text("# batch\n10\n\n20  # second\n")
    assert read_lengths_file(str(path)) == [10, 20]
    path.write_text("10\nabc\n")
    with pytest.raises(WorkloadError, match=r"l.txt:2: 'abc'"):
        read_lengths_file(str(path))
    path.write_text("\n")
    with pytest.raises(WorkloadError, match="empty"):
        read_lengths_file(str(path))
    assert video_lengths([(16, 32, 32), (1, 2, 3)]) == [16384, 6]
    with pytest.raises(WorkloadError, match="video 0"):
        video_lengths([(0, 2, 2)])


def test_idx_reader(tmp_path):
    path = str(tmp_path / "d.idx")
    write_lengths(path, [5, 17, 4096])
    assert read_idx_lengths(path) == [5, 17, 4096]
    assert read_lengths_file(path) == [5, 17, 4096]
    with open(path, "r+b") as handle:
        handle.write(b"NOTMAGIC!")
    with pytest.raises(WorkloadError, match="d.idx: not a Megatron MMIDIDX index"):
        read_idx_lengths(path)


def test_one_idx_reader_for_the_planner_and_the_data_layer(tmp_path):
    """The planner's lengths (no numpy) and the memory-mapped dataset read one index alike, and
    a truncated index is the same error in both (`megatron_dcp.plan.idx_format`)."""
    from megatron_dcp.data.indexed import IndexedDataset, IndexedDatasetWriter

    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix) as writer:
        for n in (3, 1, 7):
            writer.add_document(range(n))
    assert read_idx_lengths(prefix + ".idx") == IndexedDataset(prefix).lengths.tolist() == [3, 1, 7]
    data = (tmp_path / "ds.idx").read_bytes()
    (tmp_path / "ds.idx").write_bytes(data[:-8])
    with pytest.raises(WorkloadError, match="ds.idx is truncated") as planner:
        read_idx_lengths(prefix + ".idx")
    with pytest.raises(ValueError, match="ds.idx is truncated") as dataset:
        IndexedDataset(prefix)
    assert str(planner.value) == str(dataset.value)


# ---------------------------------------------------------------------------- cost model
def test_cost_model_memory_and_time():
    hw = load_hardware("h200")
    cm = CostModel(LLAMA, hw, world_size=32, zero_stage=1)
    mem, tm = cm.memory_model, cm.time_model
    statics = [CostModel(LLAMA, hw, world_size=32, zero_stage=z,
                         memory_budget=1e15).memory_model.static_memory for z in range(4)]
    assert statics == sorted(statics, reverse=True)
    assert 6e9 < cm.params < 7e9
    # more recompute: less memory, more time
    assert mem.memory_of(50_000, 1, 32) < mem.memory_of(50_000, 1, 0)
    pairs = cm.attn_pairs(8000)
    assert tm.best_time(8000, pairs, 1, 32)[0] > tm.best_time(8000, pairs, 1, 0)[0]
    # fewest recomputed layers that fit
    for tokens in (1000, 60_000, 150_000):
        c = mem.min_recompute_layers(tokens, 1)
        if c is not None:
            assert mem.memory_of(tokens, 1, c) <= mem.budget
            if c > 0:
                assert mem.memory_of(tokens, 1, c - 1) > mem.budget
    # a long sequence gets faster with more ranks; attention is quadratic
    n = 131072
    times = [tm.best_time(n, cm.attn_pairs(n), d, mem.min_recompute_layers(n, d))[0]
             for d in (2, 4, 8)]
    assert times == sorted(times, reverse=True)
    assert cm.attn_pairs(2000) > 3.9 * cm.attn_pairs(1000)
    # inter-node ring is slower than intra-node
    from megatron_dcp.plan.cost import Layout
    intra, inter = Layout(1, 8, True, True), Layout(1, 8, True, False)
    pairs = cm.attn_pairs(4096)
    assert tm.time_of(4096, pairs, inter, 0) > tm.time_of(4096, pairs, intra, 0)


@pytest.mark.parametrize("world, budget", [(64, None), (12, 60.0)])
def test_fitting_options_equal_the_size_by_size_rule_around_the_short_bound(world, budget):
    # PlanContext.fitting_options answers a sequence short enough for every size at once (a bound
    # computed at start): the same options as testing each vocabulary size, on both sides of the bound
    from megatron_dcp.plan.drafts import PlanContext

    cfg = DCPConfig(hardware="h200", **({"memory_budget_gb": budget} if budget else {}))
    cm = build_cost_model(LLAMA, cfg, world)
    pctx = PlanContext(lengths=[1], active=[0], cm=cm, vocab=Vocabulary.for_cost_model(cm),
                      recompute_mode="auto")
    mm = cm.memory_model
    edges = [mm.max_local_tokens(0), mm.max_local_tokens(LLAMA.num_layers)]
    lengths = sorted({max(1, e + k) for e in edges for k in range(-40, 41)} | {1, 7, 4096})
    for mode in ("auto", "none", "full"):
        for n in lengths:
            want = tuple((d, c) for d in pctx.vocab.sizes
                         if (c := pctx.recompute_for(cm.padded(n, d), d, mode)) is not None)
            assert pctx.fitting_options(n, mode) == want, (mode, n)


def test_cost_terms_table_and_per_layout_attention():
    from megatron_dcp.plan.cost import Layout

    hw = load_hardware("h200")
    cm = CostModel(LLAMA, hw, world_size=16)
    tm = cm.time_model
    ring, uly, hyb = Layout(1, 8, True, True), Layout(8, 1, True, True), Layout(2, 4, True, True)
    pairs = cm.attn_pairs(65536)
    for lay in (ring, uly, hyb, Layout(1, 16, True, False)):
        for layers in (0, 12):
            terms = tm.terms(65536, pairs, lay, layers)
            parts = tm.breakdown(65536, pairs, lay, layers)
            assert parts.compute + parts.comm + parts.overhead == pytest.approx(parts.total)
            assert tm.marginal_time(65536, pairs, lay, layers) <= parts.total
            assert (terms.p2p > 0) == (lay.ring > 1) and (terms.all_to_all > 0) == (lay.ulysses > 1)
    # attention of the same work at each layout's rate: ring slower, hybrid in between
    attn = {name: tm.terms(65536, pairs, lay, 0).attention
            for name, lay in (("ring", ring), ("ulysses", uly), ("hybrid", hyb))}
    assert attn["ring"] == pytest.approx(attn["ulysses"] * hw.attention_flops
                                         / hw.ring_attention_flops)
    assert attn["ulysses"] < attn["hybrid"] < attn["ring"]
    flat = CostModel(LLAMA, replace(hw, ring_attention_flops=None, hybrid_attention_flops=None),
                     world_size=16)
    assert flat.time_model.terms(65536, pairs, ring, 0).attention == pytest.approx(attn["ulysses"])
    # the layout choice follows the rates: with equal rates ring wins at degree 8 on this
    # sequence (its traffic hides behind attention, Ulysses' all-to-all does not)
    assert flat.time_model.best_time(65536, pairs, 8, 0)[1].ring == 8
    assert tm.best_time(65536, pairs, 8, 0)[1].ulysses == 8


def test_padding_is_the_runtimes_rule():
    from megatron_dcp.plan.plan import pad_multiple, padded_length

    assert [pad_multiple(u, r) for u, r in ((1, 1), (4, 1), (1, 4), (2, 3))] == [1, 4, 8, 12]
    assert padded_length(1001, 4, 1) == 1004 and padded_length(1001, 1, 4) == 1008
    uly = build_cost_model(LLAMA, DCPConfig(attention_layout="ulysses"), 8)
    auto = build_cost_model(LLAMA, DCPConfig(), 8)
    # before a layout is chosen the planner pads as the layout that pads most would
    assert uly.padded(1009, 8) == 1016 and auto.padded(1009, 8) == 1024
    # a planned pure-Ulysses task records the memory of the padding the runtime adds (degree),
    # not 2 x degree
    plan = plan_for([300_001] * 2, world=8, attention_layout="ulysses")
    for t in plan.tasks:
        assert t.ring == 1
        tokens = sum(padded_length(plan.lengths[s], t.ulysses, 1) for s in t.seqs)
        memory_of = uly.memory_model.memory_of
        assert t.memory == pytest.approx(memory_of(tokens, t.degree, t.recompute_layers))
        twice = sum(-(-plan.lengths[s] // (2 * t.degree)) * 2 * t.degree for s in t.seqs)
        assert t.memory < memory_of(twice, t.degree, t.recompute_layers)


def test_communicator_memory_is_static_memory():
    hw = load_hardware("h200")
    vocab = Vocabulary.for_cost_model(CostModel(LLAMA, hw, world_size=64))
    count = vocab.communicators_per_rank()
    charge = vocab.charge(hw.communicator_bytes, hw.connection_bytes)
    mem = CostModel(LLAMA, hw, world_size=64).memory_model
    none = CostModel(LLAMA, hw, world_size=64, communicators=Communicators(0, 0.0)).memory_model
    assert mem.communicators == charge and charge.per_rank == count > 10
    assert charge.bytes > 8 * hw.connection_bytes  # a dense model: send/receive only
    assert mem.static_memory - none.static_memory == pytest.approx(charge.bytes)
    # the caller may give its own; a smaller vocabulary costs less
    assert CostModel(LLAMA, hw, world_size=64, communicators=Communicators(3, 1e9)
                     ).memory_model.static_memory < mem.static_memory
    node = build_cost_model(LLAMA, DCPConfig(ulysses_scope="node"), 64).memory_model
    capped = build_cost_model(LLAMA, DCPConfig(max_degree=8), 64).memory_model
    assert node.communicators.per_rank < count and capped.communicators.per_rank < count
    assert capped.static_memory < mem.static_memory
    # gloo profiles: free
    cpu = CostModel(LLAMA, replace(hw, communicator_bytes=0.0, connection_bytes=None),
                    world_size=64).memory_model
    assert cpu.communicators.per_rank == 0 and cpu.static_memory == none.static_memory
    # the memory a task records includes it, and a budget it eats up is a clear error
    plan = make_plan([1000], world_size=64, model=LLAMA, config=DCPConfig())
    assert plan.meta["communicators_per_rank"] == count
    assert plan.meta["communicator_bytes"] == charge.bytes
    assert plan.tasks[0].memory > mem.static_memory > none.static_memory
    with pytest.raises(PlanError, match=f"{count} communicators per rank"):
        CostModel(LLAMA, hw, world_size=64, memory_budget=none.static_memory + 4.5e9)


def test_reused_cost_model_must_match():
    cm = build_cost_model(LLAMA, DCPConfig(), 8, zero_stage=3)
    plan = make_plan([100, 5000], world_size=8, model=LLAMA, config=DCPConfig(), cost_model=cm)
    assert plan.meta["zero_stage"] == 3
    for kwargs in ({"world_size": 16}, {"world_size": 8, "zero_stage": 1},
                   {"world_size": 8, "model": load_model("gpt-1b")}):
        args = {"model": LLAMA, **kwargs}
        with pytest.raises(PlanError,
                           match="cost_model is for llama-7b, DCP world 8, ZeRO stage 3"):
            make_plan([100], config=DCPConfig(), cost_model=cm, **args)


def test_budget_below_static_memory():
    """The error names the static memory and what a useful budget adds to it per token (issue
    45, item 2: the smallest useful value was found only by calling the memory model)."""
    with pytest.raises(PlanError, match="below the static memory") as err:
        plan_for([100], world=8, memory_budget_gb=10.0)
    assert re.search(r"a useful budget is above [0-9.]+ GiB by what the tasks hold: "
                     r"[0-9.]+ KiB a token .* every layer recomputed", str(err.value))


def test_ulysses_layouts_respect_heads():
    cm = build_cost_model(load_model("llama-70b"), DCPConfig(), 64, zero_stage=3)
    layouts = [lay for d in (3, 6, 16, 64) for lay in cm.layouts(d)]
    assert all(lay.ulysses <= 8 and 8 % lay.ulysses == 0 for lay in layouts)
    assert any(lay.ulysses == 1 and lay.ring == 3 for lay in cm.layouts(3))


@pytest.mark.parametrize("policy", ["dcp", "static"])
def test_attention_layout_setting_is_honoured(policy):
    # static's ring layout used to win DCP's candidates although the config asked for Ulysses
    plan = plan_for([300_000], world=8, policy=policy, attention_layout="ulysses")
    assert [(t.ulysses, t.ring) for t in plan.tasks] == [(8, 1)]
    ring = plan_for([300_000], world=8, policy=policy, attention_layout="ring")
    assert [(t.ulysses, t.ring) for t in ring.tasks] == [(1, 8)]


# ---------------------------------------------------------------------------- vocabulary
def test_vocabulary():
    v = Vocabulary(32, 8)
    assert v.sizes == (1, 2, 3, 4, 6, 8, 16, 24, 32)
    assert (0, 1, 2, 3) in v and (1, 2, 3, 4) not in v and tuple(range(8, 24)) not in v
    assert len(v) == sum(1 for _ in v.groups())
    big = Vocabulary(1024, 8)
    assert len(big) < 3000 and big.max_groups_per_rank() < 25
    assert Vocabulary(5, 8).sizes[-1] == 5


# ---------------------------------------------------------------------------- planners
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_a_valid_plan(policy):
    lengths = sample_lengths("short", 8 * 40_000, seed=1)
    plan = plan_for(lengths, world=16, policy=policy)
    cm = build_cost_model(LLAMA, DCPConfig(), 16)
    validate_plan(plan, LLAMA, cost_model=cm)
    assert plan.policy == policy
    assert plan.digest() == plan_for(lengths, world=16, policy=policy).digest()
    again = Plan.from_json(plan.to_json())
    assert again.digest() == plan.digest()
    assert simulate(plan, cm).step_time_s > 0


@pytest.mark.parametrize("dist", ["short", "balanced", "long"])
def test_dcp_search_beats_baselines_and_is_near_the_bound(dist):
    lengths = sample_lengths(dist, 32 * 65536, seed=0)
    cm = build_cost_model(LLAMA, DCPConfig(), 32)
    plans = {p: plan_for(lengths, world=32, policy=p) for p in POLICIES}
    spans = {p: simulate(plan, cm, bound=0.0, moldable_bound=0.0).makespan_s
             for p, plan in plans.items()}
    # The baselines' own plans are candidates of dcp up to 20,000 sequences x ranks, which would
    # make "dcp <= baseline" true by construction: the DCP search's own best pass must beat them.
    searched = {k: v for k, v in plans["dcp"].meta["candidates"].items() if k.startswith("dcp(")}
    assert searched, plans["dcp"].meta["candidates"]
    best_search = min(searched.values())
    for policy in ("bucket", "packed", "static", "greedy-cp", "dcp-intra"):
        assert best_search <= spans[policy] * (1 + 1e-6), (policy, best_search, spans)
    assert spans["dcp"] <= best_search * (1 + 1e-6)
    assert spans["bucket"] / spans["dcp"] > 1.3
    eff = simulate(plans["dcp"], cm).efficiency
    assert eff >= 0.9, eff


def test_dcp_uses_variable_degrees_and_per_rank_task_counts():
    lengths = sample_lengths("short", 32 * 65536, seed=0)
    plan = plan_for(lengths, world=32)
    degrees = {t.degree for t in plan.tasks}
    assert len(degrees) > 1 and max(degrees) > 1
    counts = {len(plan.tasks_for_rank(r)) for r in range(32)}
    assert len(counts) > 1
    assert any(len(t.seqs) > 1 for t in plan.tasks)  # short sequences packed


def test_recompute_layers_are_the_fewest_that_fit():
    mem = build_cost_model(LLAMA, DCPConfig(), 8).memory_model
    plan = plan_for([200_000, 1000], world=8, policy="dcp")
    for t in plan.tasks:
        tokens = sum(plan.lengths[s] for s in t.seqs)
        fewer = replace(t, recompute_layers=t.recompute_layers - 1)
        assert t.recompute_layers == 0 or mem.task_memory(fewer, plan.lengths) > mem.budget \
            or mem.min_recompute_layers(tokens, t.degree) == t.recompute_layers
    full = plan_for([200_000, 1000], world=8, policy="dcp", recompute="full")
    assert all(t.recompute_layers == LLAMA.num_layers for t in full.tasks)


def test_pack_tokens_caps_packed_tasks():
    lengths = sample_lengths("short", 8 * 40_000, seed=4)
    plan = plan_for(lengths, world=8, pack_tokens=4096)
    validate_plan(plan, LLAMA)
    for t in plan.tasks:
        if len(t.seqs) > 1:
            assert sum(plan.lengths[s] for s in t.seqs) <= 4096
    assert any(len(t.seqs) > 1 for t in plan.tasks)
    # dcp-intra is the bucket plan lightened: it plans (bucket ignores pack_tokens) instead of
    # failing when the bucket plan packs beyond the budget
    mixed = [10_000] + [100] * 50
    intra = plan_for(mixed, world=8, policy="dcp-intra", pack_tokens=150)
    validate_plan(intra, LLAMA)
    assert any(len(t.seqs) > 1 for t in intra.tasks)


def test_pack_curve_and_budget_from_the_hardware_profile(tmp_path):
    """A measured CPU profile: per-token time grows with the task size (pack_curve) and a pack
    budget (pack_tokens) the planner uses when the config sets none."""
    cpu = replace(load_hardware("h200"), name="cpu", pack_curve=[[4096, 2.0], [1024, 1.0],
                                                                    [2048, 1.0]],
                  pack_tokens=2048)
    # sorted; interpolated in log tokens, constant beyond the ends
    assert cpu.pack_curve == ((1024.0, 1.0), (2048.0, 1.0), (4096.0, 2.0))
    assert cpu.pack_factor(100) == 1.0 and cpu.pack_factor(1e6) == 2.0
    assert cpu.pack_factor(2048 * 2 ** 0.5) == pytest.approx(1.5)
    assert load_hardware("h200").pack_factor(1e6) == 1.0
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(cpu.to_dict()))
    assert load_hardware(str(path)) == cpu
    for bad in ({"pack_curve": [[0, 1.0]]}, {"pack_curve": "x"}, {"pack_tokens": 0},
                {"pack_curve": [[10, -1.0]]},
                {"pack_curve": [[1, 1.0], [1, 2.0]]}):
        with pytest.raises(HardwareError, match="pack_"):
            replace(cpu, **bad)
    # the cost model: a big task costs more per token; marginal times stay lower bounds
    flat = CostModel(LLAMA, replace(cpu, pack_curve=None), world_size=8).time_model
    cm = CostModel(LLAMA, cpu, world_size=8)
    tm = cm.time_model
    lay = cm.layouts(1)[0]
    assert tm.time_of(1024, 0, lay, 0) == pytest.approx(flat.time_of(1024, 0, lay, 0))
    assert tm.time_of(8192, 0, lay, 0) > 1.5 * flat.time_of(8192, 0, lay, 0)
    below = CostModel(LLAMA, replace(cpu, pack_curve=[[1024, 0.5], [8192, 1.0]]), world_size=8)
    for tokens in (100, 1024, 8192):
        for c in (tm, below.time_model):
            assert c.marginal_time(tokens, 0, lay, 0) <= c.time_of(tokens, 0, lay, 0)
    # ring traffic that does not hide behind attention (gloo on CPU) makes ring tasks slower
    ring = next(x for x in cm.layouts(2) if x.ring == 2)
    serial = CostModel(LLAMA, replace(cpu, comm_overlap=0.0), world_size=8).time_model
    assert serial.time_of(8192, 3e7, ring, 0) > tm.time_of(8192, 3e7, ring, 0)
    assert serial.marginal_time(8192, 3e7, ring, 0, 0.5) <= serial.time_of(8192, 3e7, ring, 0)
    with pytest.raises(HardwareError, match="comm_overlap"):
        replace(cpu, comm_overlap=1.5)
    # the planner packs within the profile's budget unless the config sets one
    lengths = sample_lengths("short", 8 * 40_000, seed=4)
    plan = make_plan(lengths, world_size=8, model=LLAMA, config=DCPConfig(), hardware=cpu)
    validate_plan(plan, LLAMA)
    packed = [sum(plan.lengths[s] for s in t.seqs) for t in plan.tasks if len(t.seqs) > 1]
    assert packed and max(packed) <= 2048
    wide = make_plan(lengths, world_size=8, model=LLAMA, config=DCPConfig(pack_tokens=8192),
                     hardware=replace(cpu, pack_curve=None))
    assert max(sum(wide.lengths[s] for s in t.seqs) for t in wide.tasks) > 2048


def test_oversize_policies():
    with pytest.raises(PlanError) as err:
        plan_for([1000, 3_000_000], world=2)
    text = str(err.value)
    assert "sequence 1 has 3000000 tokens" in text and "largest length that fits is" in text
    largest = int(text.split("largest length that fits is ")[1].split()[0])
    assert 0 < largest < 3_000_000
    truncated = plan_for([1000, 3_000_000], world=2, oversize="truncate")
    assert truncated.lengths[1] == largest
    validate_plan(truncated, LLAMA)
    skipped = plan_for([1000, 3_000_000], world=2, oversize="skip")
    assert skipped.skipped == (1,) and all(1 not in t.seqs for t in skipped.tasks)
    validate_plan(skipped, LLAMA)
    assert plan_for([largest], world=2).tasks


def test_bad_lengths_are_plan_errors():
    for bad in ([], [0], [1.5], [10, -1]):
        with pytest.raises(PlanError):
            plan_for(bad)


def test_video_dit_plan():
    dit = load_model("video-dit")
    lengths = video_lengths([(f, 32, 32) for f in (4, 16, 64, 128, 8, 8, 2)])
    plan = plan_for(lengths, world=8, model=dit)
    validate_plan(plan, dit)
    cm = build_cost_model(dit, DCPConfig(), 8)
    # bidirectional frame-local attention: cheaper than full causal over the same tokens
    assert cm.attn_pairs(131072) < 131072 ** 2 / 2


def test_gqa_plan_never_splits_kv_heads():
    model = load_model("llama-70b")
    lengths = sample_lengths("long", 64 * 40_000, seed=2)
    plan = make_plan(lengths, world_size=64, model=model, config=DCPConfig(), zero_stage=3)
    validate_plan(plan, model)
    assert all(model.kv_heads % t.ulysses == 0 for t in plan.tasks)


def test_lower_bound_below_every_plan():
    lengths = sample_lengths("balanced", 16 * 65536, seed=5)
    cm = build_cost_model(LLAMA, DCPConfig(), 16)
    bound = lower_bound(lengths, cm)
    tighter = lower_bound(lengths, cm, moldable=True)
    assert tighter >= bound
    for policy in POLICIES:
        assert simulate(plan_for(lengths, world=16, policy=policy),
                        cm).makespan_s >= tighter * (1 - 1e-9)


# ---------------------------------------------------------------------------- validation
def _tiny_plan():
    tasks = (Task(id=0, ranks=(0, 1), seqs=(0,), ulysses=2, ring=1, duration=1.0),
             Task(id=1, ranks=(2, 3), seqs=(1, 2), ulysses=1, ring=2, duration=1.0),
             Task(id=2, ranks=(0,), seqs=(3,), start=1.0, duration=1.0))
    return Plan(tasks=tasks, lengths=(10, 20, 30, 40), world_size=4)


@pytest.mark.parametrize("change, message", [
    (lambda ts: ts[:2], r"sequence\(s\) \[3\] are in no task"),
    (lambda ts: ts[:2] + (replace(ts[2], seqs=(0,)),), "sequence 0 is in task 0 and task 2"),
    (lambda ts: ts[:2] + (replace(ts[2], start=0.5),), "rank 0 is in task 0 and task 2 at the "
                                                       "same time"),
    (lambda ts: (replace(ts[0], ring=2),) + ts[1:], "ulysses 2 x ring 2 != 2 ranks"),
    (lambda ts: (replace(ts[0], ranks=(0, 9)),) + ts[1:], "outside the world"),
    (lambda ts: (replace(ts[0], ranks=(0, 2, 1), ulysses=3),) + ts[1:], "does not divide the 32 "
                                                                        "heads"),
    (lambda ts: ts[:2] + (replace(ts[2], id=1),), "task id 1 appears twice"),
])
def test_validate_plan_names_the_problem(change, message):
    good = _tiny_plan()
    validate_plan(good, LLAMA)
    bad = Plan(tasks=change(good.tasks), lengths=good.lengths, world_size=4)
    with pytest.raises(PlanError, match=message):
        validate_plan(bad, LLAMA)


def test_validate_plan_checks_memory():
    cm = build_cost_model(LLAMA, DCPConfig(), 4)
    plan = Plan(tasks=(Task(id=0, ranks=(0,), seqs=(0,)),), lengths=(400_000,), world_size=4)
    with pytest.raises(PlanError, match="task 0 needs .* above the budget"):
        validate_plan(plan, LLAMA, cost_model=cm)


def test_validate_plan_checks_the_vocabulary():
    good = _tiny_plan()
    validate_plan(good, LLAMA, vocabulary=Vocabulary(4, 4))
    odd = Plan(tasks=(replace(good.tasks[0], ranks=(1, 2)),) + good.tasks[1:], lengths=good.lengths,
               world_size=4)
    with pytest.raises(PlanError, match=r"group \[1, 2\], which is not in the group vocabulary"):
        validate_plan(odd, LLAMA, vocabulary=Vocabulary(4, 4), check_times=False)


def test_plan_json_that_is_not_an_object_is_a_clear_error():
    # tools/simulate.py --plan reports ValueError as "not a valid plan JSON" (was AttributeError)
    for text in ("[]", "5", '"plan"'):
        with pytest.raises(ValueError, match="a plan JSON must be an object"):
            Plan.from_json(text)


# ---------------------------------------------------------------------------- tensor parallel
def test_tensor_parallel_lowers_memory_and_time():
    hw = load_hardware("h200")
    tp1 = CostModel(LLAMA, hw, world_size=32, zero_stage=1)
    tp2 = CostModel(replace(LLAMA, tensor_parallel=2), hw, world_size=32, zero_stage=1)
    assert tp2.params == pytest.approx(tp1.params / 2)
    assert tp2.memory_model.static_memory < tp1.memory_model.static_memory
    for layers in (0, 16, 32):
        assert tp2.memory_model.token_bytes(layers) < tp1.memory_model.token_bytes(layers)
        # the replicated layer inputs/norm outputs do not split: more than half remains
        assert tp2.memory_model.token_bytes(layers) > tp1.memory_model.token_bytes(layers) / 2
        assert tp2.memory_model.memory_of(50_000, 2, layers) \
            < tp1.memory_model.memory_of(50_000, 2, layers)
    for tokens in (2048, 32768, 131072):
        pairs = tp1.attn_pairs(tokens)
        for d in (1, 2, 8):
            assert tp2.time_model.best_time(tokens, pairs, d, 0)[0] \
                < tp1.time_model.best_time(tokens, pairs, d, 0)[0]
    # the TP all-reduces show as communication, and grow with recompute
    from megatron_dcp.plan.cost import Layout
    lay = Layout(1, 1, True, True)
    assert tp1.time_model.breakdown(8192, tp1.attn_pairs(8192), lay, 0).comm == 0.0
    assert tp2.time_model.breakdown(8192, tp2.attn_pairs(8192), lay, 0).comm > 0.0
    tm2 = tp2.time_model
    assert tm2.time_of(8192, 1e6, lay, 32) - tm2.time_of(8192, 1e6, lay, 0) > \
        tm2.marginal_time(8192, 1e6, lay, 32) - tm2.marginal_time(8192, 1e6, lay, 16)
    # marginal times stay lower bounds of task times
    for d, lay in ((1, lay), (4, Layout(2, 2, True, True))):
        assert tp2.time_model.marginal_time(65536, tp2.attn_pairs(65536), lay, 8) <= \
            tp2.time_model.time_of(65536, tp2.attn_pairs(65536), lay, 8)


def test_tensor_parallel_one_is_the_default_model():
    hw = load_hardware("h200")
    base = CostModel(LLAMA, hw, world_size=16, zero_stage=2)
    same = CostModel(replace(LLAMA, tensor_parallel=1), hw, world_size=16, zero_stage=2)
    assert LLAMA.tensor_parallel == 1
    assert (base.params, base.memory_model.static_memory, base.memory_model.token_bytes(5)) == \
        (same.params, same.memory_model.static_memory, same.memory_model.token_bytes(5))
    assert base.params == 32 * (4096 * 3 * 4096 + 4096 * 4096 + 3 * 4096 * 11008) + 2 * 32000 * 4096
    # activations + bf16 logits and their gradient (or Megatron's fp32 softmax): `loss_bytes`
    assert base.memory_model.token_bytes(0) == \
        32 * 2 * (5 * 4096 + 2 * 4096 + 3 * 11008) + (2 + 4) * 32000
    # the planner plans with the model's TP size: a sequence that needs recompute on whole
    # ranks needs less on half of every weight and activation (and every task records the
    # memory the TP-2 cost model gives it)
    tp2 = replace(LLAMA, tensor_parallel=2)
    whole, half = plan_for([800_000], world=8), plan_for([800_000], world=8, model=tp2)
    mem2 = build_cost_model(tp2, DCPConfig(), 8).memory_model
    assert [t.degree for t in whole.tasks] == [t.degree for t in half.tasks] == [8]
    assert half.tasks[0].recompute_layers < whole.tasks[0].recompute_layers
    assert half.tasks[0].memory == pytest.approx(mem2.task_memory(half.tasks[0], half.lengths))
    assert half.tasks[0].memory <= mem2.budget


def test_bad_tensor_parallel_is_a_clear_error():
    with pytest.raises(ValueError, match="tensor_parallel=3: must divide num_heads=32"):
        replace(LLAMA, tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel=16: must divide .* num_kv_heads=8"):
        replace(load_model("llama-70b"), tensor_parallel=16)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel=.*must be a positive integer"):
            replace(LLAMA, tensor_parallel=bad)


def test_tensor_parallel_ulysses_uses_heads_per_rank():
    model = replace(load_model("llama-70b"), tensor_parallel=4)  # 2 KV heads per TP rank
    cm = build_cost_model(model, DCPConfig(), 16, zero_stage=3)
    assert all(lay.ulysses in (1, 2) for d in (2, 4, 8, 16) for lay in cm.layouts(d))
    lengths = sample_lengths("long", 16 * 40_000, seed=2)
    plan = make_plan(lengths, world_size=16, model=model, config=DCPConfig(), zero_stage=3)
    validate_plan(plan, model)
    assert all(2 % t.ulysses == 0 for t in plan.tasks)
    # Ulysses 4 divides the model's 8 KV heads but not the 2 of one TP rank
    first = plan.tasks[0]
    assert len(first.ranks) % 4 == 0
    bad = replace(first, ulysses=4, ring=len(first.ranks) // 4)
    with pytest.raises(PlanError, match="does not divide the 16 heads and 2 KV heads per "
                                        "tensor-parallel rank"):
        validate_plan(replace(plan, tasks=(bad,) + tuple(plan.tasks[1:])), model)


def test_tensor_parallel_fits_a_sequence_tp1_cannot():
    budget = 100.0
    with pytest.raises(PlanError) as err:
        plan_for([1000, 3_000_000], world=2, memory_budget_gb=budget)
    largest = int(str(err.value).split("largest length that fits is ")[1].split()[0])
    longer = int(largest * 1.3)
    with pytest.raises(PlanError):
        plan_for([longer], world=2, memory_budget_gb=budget)
    tp2 = replace(LLAMA, tensor_parallel=2)
    plan = plan_for([longer], world=2, memory_budget_gb=budget, model=tp2)
    validate_plan(plan, tp2)
    assert sum(len(t.seqs) for t in plan.tasks) == 1


def test_megatron_step_plans_with_the_tensor_parallel_size():
    step_module = pytest.importorskip("megatron_dcp.megatron.step")
    config = DCPConfig(enabled=True, hardware="h200")  # a GPU model: not "auto" on CPU
    step = step_module.DCPForwardBackward(config, model_shape=LLAMA)
    assert step.planning_shape() is LLAMA  # Megatron's parallel state not set up: TP 1
    step = step_module.DCPForwardBackward(config, model_shape=LLAMA,
                                          parallel=step_module.MegatronParallel(tensor=2))
    assert step.planning_shape() == replace(LLAMA, tensor_parallel=2)
    expected = make_plan([1000, 5000], world_size=2, model=replace(LLAMA, tensor_parallel=2),
                         config=step.config, zero_stage=step.zero_stage)
    assert step.plan_for([1000, 5000], 2).tasks == expected.tasks
    # a shape that already names its TP size is kept
    step.model_shape = replace(LLAMA, tensor_parallel=4)
    assert step.planning_shape().tensor_parallel == 4


@pytest.mark.parametrize("schedule", ["free", "lockstep"])
def test_a_budget_in_tokens_splits_what_exceeds_it(schedule):
    """``max_tokens_per_rank`` (Megatron's --max-seqlen-per-dp-cp-rank in spirit): no task holds
    more tokens per rank, while without it the same batch packs up to 5,000 tokens a rank (the
    H200's memory holds them: no GiB figure decides here)."""
    lengths = [6000, 6000, 3000, 3000, 1000, 500]

    def per_rank(plan):
        return [math.ceil(sum(lengths[s] for s in t.seqs) / t.degree) for t in plan.tasks]

    assert max(per_rank(plan_for(lengths, world=4, schedule=schedule))) > 3000
    capped = plan_for(lengths, world=4, schedule=schedule, max_tokens_per_rank=3000)
    assert max(per_rank(capped)) <= 3000, per_rank(capped)
    assert sorted(s for t in capped.tasks for s in t.seqs) == list(range(len(lengths)))
    with pytest.raises(PlanError, match="3000 tokens per rank .dcp.max_tokens_per_rank.*raise "
                                        "dcp.max_tokens_per_rank"):  # 6,000 need 2 ranks
        plan_for(lengths, world=1, schedule=schedule, max_tokens_per_rank=3000)
    with pytest.raises(Exception, match="max_tokens_per_rank"):
        DCPConfig(max_tokens_per_rank=0)
