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
