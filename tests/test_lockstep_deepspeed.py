"""ZeRO-2 and ZeRO-3 keep their sharding under ``--dcp`` (lockstep plans), launched as users do.

One ``deepspeed`` launch per world size (2 and 4, gloo on CPU) runs this file as the training
script. For ZeRO-2 and ZeRO-3 (every parameter partitioned: persistence threshold 0), it trains
the reference decoder for ``ITERS`` steps with ``--dcp`` and with plain DeepSpeed on the same
global batches, and records after every micro-step's backward and every step what a rank holds:

* ZeRO-3: parameters gathered (elements) and its partition of them;
* ZeRO-2: gradients on the parameters (a full local gradient) and its gradient partition.

The memory budget is the smallest that fits the longest sequence, so plans use sequence-parallel
groups and recompute. A free schedule (``dcp.schedule=free``: coalesced reduction, ZeRO-3
parameters kept gathered) runs one step as the negative control: the same checks see its full
gradients and gathered parameters.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import launch_deepspeed  # noqa: E402
from test_deepspeed_parity import _tight_budget  # noqa: E402

pytestmark = pytest.mark.slow  # every test here launches processes

ITERS = 5
REL_TOL = 1e-5
LENGTHS = [512, 384, 300, 200, 90, 40, 20, 7, 130, 256]


def _batches(seed: int = 3):
    """Global batches of up to 2048 tokens, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(ITERS):
        order = torch.randperm(len(LENGTHS), generator=g).tolist()
        lengths, total = [], 0
        for k in order:
            if total + LENGTHS[k] <= 2048:
                lengths.append(LENGTHS[k])
                total += LENGTHS[k]
        yield [torch.randint(0, 257, (n,), generator=g) for n in lengths]


def _held(engine, stage: int) -> dict:
    """Elements this rank holds: parameters gathered and its partition (ZeRO-3); gradients on
    the parameters and its gradient partition (ZeRO-2)."""
    params = list(engine.module.parameters())
    grads = sum(p.grad.numel() for p in params if p.grad is not None)
    if stage == 3:
        return {"gathered": sum(p.data.numel() for p in params), "grads": grads,
                "partition": sum(p.ds_tensor.numel() for p in params),
                "full": sum(p.ds_numel for p in params)}
    opt = engine.deepspeed.optimizer
    return {"grads": grads, "full": sum(p.numel() for p in params),
            "partition": sum(t.numel() for t in opt.single_partition_of_fp32_groups)}


def _run(stage: int, world: int, mode: str, iters: int) -> tuple[list[float], list[dict]]:
    import deepspeed_plugin
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models.decoder import Decoder, DecoderConfig

    model = Decoder(DecoderConfig(vocab_size=257, hidden_size=32, num_layers=2, num_heads=4,
                                  max_position=512), seed=7)
    zero = {"stage": stage}
    if stage == 3:  # every parameter partitioned (the default keeps small ones whole)
        zero.update(stage3_param_persistence_threshold=0, stage3_model_persistence_threshold=0)
    config = {"gradient_clipping": 1.0, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    dcp = DCPConfig()
    if mode != "dp":
        dcp = DCPConfig(enabled=True, memory_budget_gb=float(_tight_budget(world, stage)),
                        hardware="h200",  # the budget's hardware (its 4 GB reserve)
                        schedule="free" if mode == "free" else "auto")
    engine, *_ = deepspeed_plugin.initialize(model=model, model_parameters=model.parameters(),
                                             config=config, dcp_config=dcp)
    held: list[dict] = []
    backward = engine._steps.backward  # the driver's protocol: DCPEngine's private adapter

    def recorded(loss, last):
        backward(loss, last)
        held.append({"when": "micro-step", **_held(engine, stage)})

    engine._steps.backward = recorded
    losses = []
    for batch, _ in zip(_batches(), range(iters)):
        result = engine.train_step(batch)
        assert mode == "dp" or result.plan.lockstep == (mode == "dcp")
        losses.append(result.loss)
        tasks = result.plan.tasks
        held.append({"when": "step", "slots": result.micro_steps, **_held(engine, stage),
                     "degree": max((t.degree for t in tasks), default=1),
                     "recompute": max((t.recompute_layers for t in tasks), default=0)})
    engine.deepspeed.destroy()  # its ZeRO hooks would keep it (and its groups) alive to exit
    return losses, held


def _driver(out: str) -> None:
    """Both stages in turn; a stage that raises is reported as {"failed": traceback} and the
    next still runs (each stage is its own test case on the pytest side)."""
    import traceback

    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    report: dict = {}
    for stage in (2, 3):
        try:
            runs = {mode: _run(stage, world, mode, ITERS if mode != "free" else 1)
                    for mode in ("dcp", "dp", "free")}
            # every rank's holdings: rank 0 collects them
            gathered: list = [None] * world
            dist.all_gather_object(gathered, {m: held for m, (_, held) in runs.items()})
            report[stage] = {"losses": {m: losses for m, (losses, _) in runs.items()},
                             "held": gathered}
        except Exception:  # noqa: BLE001 - reported as this stage's failure
            report[stage] = {"failed": f"rank {rank}: " + traceback.format_exc()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()


def _check(got: dict, stage: str, world: int) -> None:
    dcp, dp = got["losses"]["dcp"], got["losses"]["dp"]
    assert len(dcp) == len(dp) == ITERS
    for i, (a, b) in enumerate(zip(dcp, dp)):
        assert abs(a - b) <= REL_TOL * abs(b), f"ZeRO {stage} iteration {i + 1}: {a} vs {b}"
    for rank_held in got["held"]:
        steps = [h for h in rank_held["dcp"] if h["when"] == "step"]
        assert len(rank_held["dcp"]) == len(steps) + sum(h["slots"] for h in steps)
        # the plans use sequence-parallel groups and recompute beside ZeRO's collectives
        assert max(h["degree"] for h in steps) > 1 and max(h["recompute"] for h in steps) > 0
        for h in rank_held["dcp"]:
            # the partition is this rank's 1/W share (up to DeepSpeed's alignment padding)
            assert h["partition"] * world >= h["full"]
            assert h["partition"] <= h["full"] / world + 64, h
            if stage == "3":
                assert h["grads"] == 0, h
                if h["when"] == "step":
                    assert h["gathered"] == 0, h  # nothing gathered between steps
                else:  # at most what ZeRO-3 prefetches for the next micro-step
                    assert h["gathered"] <= h["full"] / world, h
            else:
                assert h["grads"] == 0, h  # reduced into the partition at every micro-step
        # negative control: the free schedule holds the whole model (the check can fail)
        free = rank_held["free"]
        if stage == "3":
            assert all(h["gathered"] == h["full"] for h in free), free
        else:
            assert any(h["grads"] == h["full"] for h in free if h["when"] == "micro-step")


_LAUNCHES: dict = {}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", ["2", "3"])
def test_zero2_zero3_keep_sharding_and_match_plain_deepspeed(world_size, stage):
    """One launch per world size runs both stages; each stage is its own case."""
    if world_size not in _LAUNCHES:
        out = tempfile.mktemp(suffix=".json")
        proc = launch_deepspeed(world_size, [__file__, "--out", out], timeout=380)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        with open(out) as f:
            _LAUNCHES[world_size] = json.load(f)
    got = _LAUNCHES[world_size][stage]
    if "failed" in got:
        pytest.fail(got["failed"])
    _check(got, stage, world_size)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    try:
        _driver(a.out)
    finally:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()
