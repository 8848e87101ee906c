"""``dcp.long_sequences`` in DeepSpeed training runs (issue 29): the driver plans every step with
the long-sequence choices, the tasks carry MLP tiles, loss tiles and offloaded layers to the
model, the default objective tiles the loss inside the model's forward (where ZeRO-3 gathers the
output projection), and training equals plain DeepSpeed on the same global batches (fp32,
relative 1e-5): ZeRO-1 (free plan), ZeRO-2 and ZeRO-3 with every parameter partitioned (lockstep:
every task and empty micro-step of a slot runs the slot's MLP tiles). Every backward runs on a fresh
thread, as CUDA's autograd worker (every recompute: layers, offloaded layers, MLP and loss
tiles, runs there)."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import run_distributed  # noqa: E402
from long_cases import (batch, decoder_config, long_budget_gb, long_choices,  # noqa: E402
                        small_tiles)

pytestmark = pytest.mark.slow  # every test here launches processes

STEPS = 2
REL_TOL = 1e-5
GROUP_TIMEOUT_S = 60.0


def _train(rank: int, world: int, stage: int, long: bool) -> dict:
    import os

    import torch

    import deepspeed_plugin
    from executor_cases import on_fresh_thread
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models.decoder import Decoder

    small_tiles()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    model = Decoder(decoder_config(), seed=7)
    zero = {"stage": stage}
    if stage == 3:  # every parameter partitioned (the default keeps small ones whole)
        zero.update(stage3_param_persistence_threshold=0, stage3_model_persistence_threshold=0)
    # SGD: Adam's first steps move every weight by about lr x sign(gradient), so a gradient that
    # is ~0 moves by the sign of its rounding; SGD's update is as exact as the gradient
    config = {"gradient_clipping": 0.0, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True}
    dcp = DCPConfig(enabled=long, hardware="h200", liveness_interval_s=0, long_sequences=long,
                    memory_budget_gb=long_budget_gb(model.shape(), world, stage) if long
                    else None)
    engine, *_ = deepspeed_plugin.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config,
        dcp_config=dcp,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    backward = engine._steps.backward
    engine._steps.backward = lambda loss, last: on_fresh_thread(lambda: backward(loss, last))
    try:
        losses, choices = [], []
        for step in range(STEPS):
            result = engine.train_step(batch(step))
            losses.append(result.loss)
            choices.append(long_choices(result.plan) if long else {})
        if stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        else:
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        return {"losses": losses, "params": params, "choices": choices,
                "lockstep": bool(long and result.plan.lockstep)}
    finally:
        engine.deepspeed.destroy()


def _both(rank: int, world: int, stage: int) -> dict:
    return {"long": _train(rank, world, stage, True), "dp": _train(rank, world, stage, False)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3], ids=["zero1-free", "zero2-lockstep",
                                                  "zero3-lockstep"])
def test_long_sequence_plans_train_as_plain_deepspeed(stage):
    results = run_distributed(_both, 2, args=(stage,), timeout_s=280.0,
                              group_timeout_s=GROUP_TIMEOUT_S, grace_s=GROUP_TIMEOUT_S + 10)
    for rank, got in enumerate(results):
        long, dp = got["long"], got["dp"]
        assert long["lockstep"] == (stage >= 2)
        for choices in long["choices"]:  # the plans tile and offload
            assert choices["mlp_tiles"] > 1 and choices["loss_tiles"] > 1, choices
            assert choices["offload_layers"] > 0, choices
        for a, b in zip(long["losses"], dp["losses"], strict=True):
            assert abs(a - b) <= REL_TOL * abs(b), (stage, rank, long["losses"], dp["losses"])
        for name, p in dp["params"].items():
            err = float((long["params"][name] - p).norm() / p.norm().clamp_min(1e-30))
            assert err <= REL_TOL, f"ZeRO-{stage}, rank {rank}: {name} rel. error {err:.2e}"
