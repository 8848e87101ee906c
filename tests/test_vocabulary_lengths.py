"""The groups created at start-up follow the lengths the job will see (``vocabulary_lengths=``).

Through the real `deepspeed_plugin.initialize` and Megatron's `DCPForwardBackward` at 2 ranks
(gloo): lengths of short documents only create fewer communicators than the default vocabulary
(none: size 1 packs them), and a batch whose default plan runs its longest sequence on a 2-rank
group falls back to the best plan within the vocabulary (here size 1: the memory of the
communicators not created lets it fit), creates no group inside the step and trains the same
loss. The memory budget is the smallest one at which the default vocabulary plans that batch.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import run_distributed, smallest_budget_gb  # noqa: E402
from executor_cases import build_model, make_batch  # noqa: E402

GROUP_TIMEOUT_S = 30.0
WORLD = 2
SHORT = list(range(2, 13))
"""The lengths the vocabulary is chosen from: short documents only."""
BATCH = (60, 9, 17, 5)
"""Sequence 0 runs on 2 ranks in the default vocabulary's plan at the budget used."""


def _config(budget_gb: float):
    from megatron_dcp.config import DCPConfig

    return DCPConfig(enabled=True, hardware="h200", calibration="off", liveness_interval_s=0,
                     memory_budget_gb=budget_gb)


def _budget_gb() -> float:
    """The smallest budget at which the default vocabulary plans `BATCH` (ZeRO 0)."""
    from megatron_dcp.plan import make_plan

    shape = build_model("decoder").shape()
    return float(smallest_budget_gb(
        lambda gb: make_plan(list(BATCH), world_size=WORLD, model=shape, config=_config(gb),
                             zero_stage=0), 1e-3, 100.0))


def _summary(pool, vocabulary, plan) -> dict:
    return {"startup": dict(pool.startup),
            "sizes": None if vocabulary is None else tuple(vocabulary.sizes),
            "tasks": [(len(t.ranks), t.seqs) for t in plan.tasks],
            "plan_sizes": plan.meta.get("vocabulary_sizes")}


def _deepspeed(rank: int, world: int, budget_gb: float) -> dict:
    """One step of the tiny decoder on `BATCH` per vocabulary (from `SHORT`, and the default)."""
    import os

    import deepspeed_plugin

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    out = {}
    for name, lengths in (("short", SHORT), ("default", None)):
        model = build_model("decoder")
        config = {"gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
        engine, *_ = deepspeed_plugin.initialize(
            model=model, model_parameters=model.parameters(), config=config,
            dcp_config=_config(budget_gb), timeout=timedelta(seconds=GROUP_TIMEOUT_S),
            vocabulary_lengths=lengths)
        try:
            result = engine.train_step(make_batch(BATCH, model.config.vocab_size))
            driver = engine.driver
            out[name] = {**_summary(driver.pool, driver.vocabulary, result.plan),
                         "loss": result.loss, "created_in_step": result.stats.groups_created}
        finally:
            engine.driver.close()
            engine.deepspeed.destroy()
    return out


def _megatron(rank: int, world: int, budget_gb: float) -> dict:
    """`DCPForwardBackward`'s start-up groups and its plan of `BATCH` per vocabulary."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.megatron.step import DCPForwardBackward

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    shape = build_model("decoder").shape()
    out = {}
    try:
        for name, lengths in (("short", SHORT), ("default", None)):
            step = DCPForwardBackward(_config(budget_gb), model_shape=shape,
                                      vocabulary_lengths=lengths)
            driver = step.driver  # groups created here (collective)
            out[name] = _summary(driver.pool, driver.vocabulary, step.plan_for(list(BATCH)))
            step.close()
    finally:
        destroy_model_parallel()
    return out


def _check(results: list[dict]) -> None:
    for got in results:
        short, default = got["short"], got["default"]
        # the groups follow the lengths: short documents need no communicator at all
        assert short["sizes"] == (1,) and default["sizes"] is None
        assert short["startup"]["max_per_rank"] == 0 < default["startup"]["max_per_rank"]
        assert short["startup"]["communicators"] < default["startup"]["communicators"]
        # the batch wants a 2-rank group the vocabulary lacks: planned within it instead
        assert any(size == 2 and 0 in seqs for size, seqs in default["tasks"]), default
        assert short["plan_sizes"] == [1] and all(size == 1 for size, _ in short["tasks"])
        assert default["plan_sizes"] is None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_deepspeed_initialize_creates_the_groups_the_lengths_need():
    results = run_distributed(_deepspeed, WORLD, args=(_budget_gb(),), timeout_s=110.0,
                              group_timeout_s=GROUP_TIMEOUT_S, grace_s=GROUP_TIMEOUT_S + 10)
    _check(results)
    for got in results:
        short, default = got["short"], got["default"]
        assert short["created_in_step"] == 0 and default["created_in_step"] == 0
        assert abs(short["loss"] - default["loss"]) <= 1e-5 * abs(default["loss"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_megatron_forward_backward_creates_the_groups_the_lengths_need():
    pytest.importorskip("megatron.core")
    results = run_distributed(_megatron, WORLD, args=(_budget_gb(),), timeout_s=110.0,
                              group_timeout_s=GROUP_TIMEOUT_S, grace_s=GROUP_TIMEOUT_S + 10)
    _check(results)


def test_sampler_distinct_lengths_are_those_its_batches_hold():
    from megatron_dcp.data import GlobalBatchSampler

    sampler = GlobalBatchSampler([1, 5, 300, 40, 5, 2000, 0], 256, max_seq_len=256)
    assert sampler.distinct_lengths() == [5, 40, 256]  # 1-token and empty documents skipped
    whole = GlobalBatchSampler([7, 3, 7], 17, min_seq_len=1)
    assert whole.distinct_lengths() == [3, 7]
