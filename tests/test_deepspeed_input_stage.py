"""The DeepSpeed plugin's lengths-first input stage (``engine.train_step(share, local=True)``,
`megatron_dcp.runtime.input_stage`, issue 58 item 2): each rank passes only its own share of the
global batch and receives only the tokens of its own tasks, with the same plans (the plan made
ahead included), losses and parameters as the whole batch on every rank; a bad share on one
rank is refused on every rank alike (no rank left waiting in the exchange). 2 gloo ranks."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import run_distributed  # noqa: E402
from executor_cases import build_model, make_batch  # noqa: E402

pytestmark = pytest.mark.slow  # launches processes

STEPS = 3
LENGTHS = (24, 17, 20, 13, 30, 9, 22, 5)
REL_TOL = 1e-6


def _engine(rank: int, world: int, enabled: bool):
    import deepspeed_plugin
    from megatron_dcp.config import DCPConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    model = build_model("decoder")
    config = {"gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    # a 48-token pack: the planner puts several sequences in a task, not all on every rank;
    # calibration off: a plan after a calibrated step would depend on measured times
    dcp = DCPConfig(enabled=enabled, hardware="h200", liveness_interval_s=0, pack_tokens=48,
                    memory_budget_gb=None, calibration="off")
    engine, *_ = deepspeed_plugin.initialize(
        model=model, model_parameters=model.parameters(), config=config, dcp_config=dcp,
        timeout=timedelta(seconds=60))
    return engine, model.config.vocab_size


def _batch(step: int, vocab: int) -> list:
    lengths = LENGTHS[step % 2:] + LENGTHS[:step % 2]  # another order each step
    return make_batch(lengths, vocab, seed=11 + step)


def _train(rank: int, world: int, enabled: bool, local: bool) -> dict:
    engine, vocab = _engine(rank, world, enabled)
    try:
        out = {"losses": [], "plans": [], "received": [], "needed": [], "ahead": []}
        for step in range(STEPS):
            batch = _batch(step, vocab)
            following = [int(s.shape[0]) for s in _batch(step + 1, vocab)]
            if local:
                share = list(np.array_split(np.arange(len(batch)), world)[rank])
                nxt = np.array_split(np.arange(len(following)), world)[rank]
                result = engine.train_step([batch[i] for i in share], local=True,
                                           next_lengths=[following[i] for i in nxt])
                out["received"].append(engine.received_tokens)
            else:
                result = engine.train_step(batch, next_lengths=following)
            plan = result.plan
            out["needed"].append(sum(plan.lengths[s] for t in plan.tasks if rank in t.ranks
                                     for s in t.seqs))
            out["losses"].append(result.loss)
            out["plans"].append(plan.digest())
            out["ahead"].append(bool(plan.meta.get("made_ahead")))
        out["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        return out
    finally:
        engine.driver.close()
        engine.deepspeed.destroy()


def _refused(rank: int, world: int) -> str:
    import torch

    engine, vocab = _engine(rank, world, True)
    try:
        share = make_batch(LENGTHS[:2], vocab)
        if rank == 1:
            share[1] = share[1].to(torch.float32)
        try:
            engine.train_step(share, local=True)
        except ValueError as err:
            return str(err)
        return "ran"
    finally:
        engine.driver.close()
        engine.deepspeed.destroy()


def _body(rank: int, world: int) -> dict:
    return {"dcp-whole": _train(rank, world, True, False),
            "dcp-local": _train(rank, world, True, True),
            "dp-whole": _train(rank, world, False, False),
            "dp-local": _train(rank, world, False, True),
            "refused": _refused(rank, world)}


@pytest.mark.timeout(300)
def test_each_rank_receives_its_tasks_tokens_only_with_the_same_training():
    results = run_distributed(_body, 2, timeout_s=280.0)
    total = sum(LENGTHS)
    for mode in ("dcp", "dp"):
        for rank, got in enumerate(results):
            whole, local = got[f"{mode}-whole"], got[f"{mode}-local"]
            assert local["plans"] == whole["plans"], (mode, rank)
            for a, b in zip(local["losses"], whole["losses"], strict=True):
                assert abs(a - b) <= REL_TOL * abs(b), (mode, rank, local["losses"])
            for name, p in whole["params"].items():
                assert float((local["params"][name] - p).abs().max()) <= REL_TOL * float(
                    p.abs().max()), (mode, rank, name)
            # a rank receives exactly the tokens of its own tasks' sequences
            assert local["received"] == local["needed"], (mode, rank)
            assert all(n < total for n in local["received"]), (mode, rank)
        if mode == "dcp":  # the next batch's lengths gathered with this one's: planned ahead
            assert all(got["dcp-local"]["ahead"][1:] for got in results)
    messages = {got["refused"] for got in results}
    assert messages == {"train_step(local=True): rank 1's sequence 1 is a 1-D torch.float32 "
                        "tensor: each sequence is a 1-D integer tensor of token ids"}
