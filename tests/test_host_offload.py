"""The engine's host-memory offload reaches the planner in real runs (issue 29): DeepSpeed's
``offload_optimizer`` / ``offload_param`` and Megatron's ``--optimizer-cpu-offload`` take the
optimizer states (and ZeRO-3 parameter partitions) out of the planner's static device memory,
through `StepDriver` into every cost model it builds."""

from __future__ import annotations

import pytest
import torch

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan import build_cost_model, make_plan
from megatron_dcp.plan.plan import PlanError
from megatron_dcp.plan.presets import load_model
from megatron_dcp.runtime.step import StepDriver

MODEL = load_model("llama-7b")
CONFIG = DCPConfig(enabled=True, hardware="h100")
LONG = [200_000]  # fits 8 H100s at ZeRO-3 only with many layers recomputed


def _recomputed(plan) -> int:
    return sum(t.recompute_layers for t in plan.tasks)


def test_offloaded_optimizer_states_leave_room_for_activations():
    kept = make_plan(LONG, world_size=8, model=MODEL, config=CONFIG, zero_stage=3)
    off = make_plan(LONG, world_size=8, model=MODEL, config=CONFIG, zero_stage=3,
                    offload_optimizer=True)
    assert _recomputed(off) < _recomputed(kept)
    on = build_cost_model(MODEL, CONFIG, 8, zero_stage=3).memory_model.static_memory
    host = build_cost_model(MODEL, CONFIG, 8, zero_stage=3,
                            offload_optimizer=True).memory_model.static_memory
    params = build_cost_model(MODEL, CONFIG, 8, zero_stage=3).memory_model.geometry.zero_params
    # fp32 master weights and Adam moments (12 B per parameter, sharded over 8) and, at ZeRO-2/3,
    # DeepSpeed's gradient partitions (2 B) move to the host
    assert on - host == pytest.approx(14.0 * params / 8)


def test_offload_param_needs_zero_3_and_a_free_plan_holds_parameters_gathered():
    with pytest.raises(PlanError, match="offload_param needs ZeRO stage 3"):
        make_plan(LONG, world_size=8, model=MODEL, config=CONFIG, zero_stage=1,
                  offload_param=True)
    free = CONFIG.replace(schedule="free")  # ZeRO-3 free plans keep parameters gathered
    a = make_plan(LONG, world_size=8, model=MODEL, config=free, zero_stage=3)
    b = make_plan(LONG, world_size=8, model=MODEL, config=free, zero_stage=3, offload_param=True)
    assert a.digest() == b.digest()
    lockstep = make_plan(LONG, world_size=8, model=MODEL, config=CONFIG, zero_stage=3,
                         offload_param=True)
    assert _recomputed(lockstep) <= _recomputed(a)


def test_the_step_driver_plans_with_the_engines_offload():
    driver = StepDriver(CONFIG, pool=None, model_shape=MODEL, zero_stage=3,
                        offload_optimizer=True)
    want = make_plan(LONG, world_size=8, model=MODEL, config=CONFIG, zero_stage=3,
                     offload_optimizer=True)
    assert driver.plan(LONG, world_size=8).digest() == want.digest()
    plain = StepDriver(CONFIG, pool=None, model_shape=MODEL, zero_stage=3)
    assert plain.plan(LONG, world_size=8).digest() != want.digest()


class _Engine:
    """What `host_offload` reads of a DeepSpeed engine (its public accessors)."""

    def __init__(self, stage: int, zero: dict) -> None:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        self.stage, self.zero = stage, DeepSpeedZeroConfig(stage=stage, **zero)

    def zero_offload_optimizer(self):
        return self.zero.offload_optimizer

    def zero_offload_param(self):
        return self.zero.offload_param

    def zero_optimization_stage(self) -> int:
        return self.stage


@pytest.mark.parametrize("stage, zero, want", [
    (1, {}, (False, False)),
    (2, {"offload_optimizer": {"device": "cpu"}}, (True, False)),
    (3, {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
         "offload_param": {"device": "cpu"}}, (True, True)),
    (3, {"offload_optimizer": {"device": "none"}}, (False, False)),
    (3, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, (False, False)),  # partial
])
def test_deepspeed_offload_settings_are_read(stage, zero, want):
    pytest.importorskip("deepspeed")
    from deepspeed_plugin.engine import host_offload

    got = host_offload(_Engine(stage, zero))
    assert (got["offload_optimizer"], got["offload_param"]) == want


def test_every_stash_copies_on_the_one_high_priority_stream_of_its_device(monkeypatch):
    """Issue 46, item 8: the stashes of successive micro-steps share one offload stream per
    device, made once with high priority (a new default-priority stream per stash shared
    NCCL's low-priority pool). ``torch.cuda.Stream`` is recorded (no GPU here)."""
    import megatron_dcp.runtime.offload as offload

    made = []
    monkeypatch.setattr(offload, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: made.append(kw) or object())
    device = torch.device("cuda", 0)
    streams = {id(offload.HostStash()._side_stream(device)) for _ in range(5)}
    assert len(streams) == 1 and made == [{"device": 0, "priority": -1}]
    offload.HostStash()._side_stream(torch.device("cuda", 1))
    assert made[1] == {"device": 1, "priority": -1}


def test_host_buffers_are_sized_to_a_grain_and_reused():
    """Issue 46 item 8: offloaded inputs go into buffers of a pool: sized to a 2 MiB grain (the
    caching host allocator rounds pinned blocks to a power of two), reused when they fit, and
    never more held than the most in use at once."""
    from megatron_dcp.runtime.offload import POOL_GRAIN, HostPool

    pool = HostPool(pinned=False)
    a = pool.take(5 << 20)
    assert a.numel() == 6 << 20 == 3 * POOL_GRAIN  # a power of two would be 8 MiB
    pool.give(a)
    b = pool.take((5 << 20) + 1)
    assert b.data_ptr() == a.data_ptr() and pool.allocations == 1
    c = pool.take(1 << 20)  # 6 MiB is too large for 1 MiB: a buffer of its own
    assert c.data_ptr() != b.data_ptr() and c.numel() == POOL_GRAIN
    assert pool.in_use_bytes == pool.peak_bytes == 8 << 20
    pool.give(b)
    pool.give(c)
    big = pool.take(20 << 20)  # the free 6 + 2 MiB do not fit: held would exceed the peak
    pool.give(big)
    assert pool.peak_bytes == 20 << 20 and pool.held_bytes <= pool.peak_bytes
    assert pool.take(20 << 20).data_ptr() == big.data_ptr()


def test_offloaded_steps_reuse_the_pool_and_train_the_same(monkeypatch):
    """Two steps of offloaded layers (backward on a fresh thread, as CUDA's autograd worker
    runs it): the second allocates no host buffer, and the gradients equal those of the same
    layers recomputed without offload."""
    import threading

    import megatron_dcp.runtime.offload as offload

    monkeypatch.setattr(offload, "_POOLS", {})
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    layer = lambda x: torch.tanh(x @ w)  # noqa: E731

    def step(offloaded: bool) -> torch.Tensor:
        w.grad = None
        x = torch.randn(3000, 64, generator=torch.Generator().manual_seed(1))
        stash = offload.HostStash()
        for _ in range(3):
            x = offload.offloaded_layer(layer, x, stash=stash) if offloaded else \
                torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        worker = threading.Thread(target=lambda: x.square().sum().backward())
        worker.start()
        worker.join()
        return w.grad.clone()

    first = step(True)
    pool = offload.host_pool(torch.device("cpu"))
    made = pool.allocations
    assert made == 3 and pool.in_use_bytes == 0
    assert torch.equal(step(True), first) and pool.allocations == made
    assert torch.equal(step(False), first)
