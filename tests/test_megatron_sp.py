"""Megatron's sequence parallelism (TP 2, ``sequence_parallel``) under DCP equals one process.

DP 2 x TP 2 at 4 ranks, the tiny GPT and plan of tests/test_megatron.py: a degree-2 Ulysses task
whose local shard (19 tokens) is not a multiple of TP, a ring task, packed tasks, recompute 0..3.
Every shard is padded to a multiple of TP at its end; the padding must change nothing. Compared
with Megatron's local spec in one process: loss and every gradient (after Megatron's gradient
finalisation, which sums the SP norms' gradients over TP), relative error <= 1e-5, with backward
on the calling thread and on a fresh thread (as CUDA's autograd engine runs it).
"""

from __future__ import annotations

import pytest

import test_megatron as tm
from distributed import run_distributed


def _build_sp(tp: int, dcp: bool, seed: int = 7):
    """`test_megatron._build` with ``sequence_parallel`` and DCP's block spec (SP-capable norms,
    the final one included)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_dcp.megatron.cpu.core import enable_cpu, seed_rng
    from megatron_dcp.megatron.spec import get_gpt_block_dcp_spec

    assert dcp and tp == 2
    enable_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_rng(seed)
    config = tm._tiny_config(tp)
    config.sequence_parallel = True
    return GPTModel(config, get_gpt_block_dcp_spec(config), vocab_size=tm.VOCAB,
                    max_sequence_length=64, position_embedding_type="rope")


def _sp_steps(rank, world_size, state, modes, sequence_parallel=True):
    if sequence_parallel:
        tm._build = _build_sp
    return {mode: tm._dcp_step(rank, world_size, 2, tm.PLAN_2, state, "token", mode)
            for mode in modes}


def test_local_shards_need_padding():
    """The plan really has a shard whose length is not a multiple of TP (37 tokens, Ulysses 2:
    19 per rank) and one that is (the ring task's 14)."""
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.layout import ShardLayout

    plan = Plan.from_dict(tm.PLAN_2)
    sizes = [ShardLayout.build([tm.LENGTHS[s] for s in t.seqs], t.ulysses, t.ring, 0).num_tokens
             for t in plan.tasks]
    assert any(n % 2 for n in sizes) and any(n % 2 == 0 for n in sizes), sizes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dp2_tp2_sequence_parallel_matches_single_process():
    reference = run_distributed(tm._reference, world_size=1, timeout_s=120)[0]
    modes = (None, "thread")
    results = run_distributed(_sp_steps, world_size=4, args=(reference[0], modes),
                              timeout_s=200)
    for mode in modes:
        tm._check([r[mode] for r in results], reference, 2)


def test_cost_model_counts_sequence_parallel():
    """SP divides a token's layer-input and norm bytes by tp and turns each TP all-reduce into an
    all-gather + reduce-scatter (same volume, twice the latency); without SP nothing changes."""
    from dataclasses import replace

    from megatron_dcp.plan.cost import CostModel, Layout
    from megatron_dcp.plan.hardware import load_hardware
    from megatron_dcp.plan.model import ModelShape

    base = ModelShape(num_layers=4, hidden_size=512, num_heads=8, ffn_hidden_size=2048,
                      vocab_size=1000, tensor_parallel=2)
    plain, sp = (CostModel(replace(base, sequence_parallel=on), load_hardware("h200"),
                           world_size=4) for on in (False, True))
    assert CostModel(base, load_hardware("h200"), world_size=4).memory_model.token_bytes(1) \
        == plain.memory_model.token_bytes(1)
    assert sp.act_bytes == pytest.approx(plain.act_bytes - 2 * 3 * 512 / 2)
    assert sp.memory_model.token_bytes(2) < plain.memory_model.token_bytes(2)
    a, b = (m.time_model.terms(4096, 4096 ** 2 / 2, Layout(1, 1, True, True), 1)
            for m in (plain, sp))
    assert b.tensor_parallel == a.tensor_parallel
    assert b.tensor_parallel_latency == pytest.approx(2 * a.tensor_parallel_latency)


# TP 2 x PP 2 at 4 ranks (DP 1: a DCP world of one): three slots of packed tasks whose shards
# (29, 30 and 19 tokens) are padded to a multiple of TP; recompute 1, 2 and 0 layers per stage.
SP_PP_TASKS = [dict(seqs=(0,), recompute_layers=1), dict(seqs=(1, 2, 3), recompute_layers=2),
               dict(seqs=(4, 5), recompute_layers=0)]


def _sp_pp_steps(rank, world_size, state):
    import test_megatron_pipeline as tp
    from megatron_dcp.plan.plan import Plan, Task

    tasks = tuple(Task(id=i, ranks=(0,), start=float(i), slot=i, **t)
                  for i, t in enumerate(SP_PP_TASKS))
    plan = Plan(tasks=tasks, lengths=tp.LENGTHS, world_size=1, policy="test").to_dict()
    return [tp._dcp(rank, world_size, state, fresh, plan=plan, tp=2, sp=True)
            for fresh in (False, True)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp2_pp2_sequence_parallel_matches_single_process():
    """--sequence-parallel with pipeline parallelism: the P2P activations are the TP rank's
    part of the padded sequence (variable shapes); loss and every gradient as one process, also
    with backward on a fresh thread."""
    import test_megatron_pipeline as tp

    reference = run_distributed(tp._reference, world_size=1, timeout_s=120)[0]
    results = run_distributed(_sp_pp_steps, world_size=4, args=(reference[0],), timeout_s=200)
    for i in range(2):
        tp.check_against_reference([r[i] for r in results], reference, tp=2)
