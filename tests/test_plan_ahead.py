"""Plans made ahead (issue 21): the next global batch is planned on a background thread while a
step runs (`megatron_dcp.runtime.plan_ahead`), from inputs every rank holds alike.

* A plan made ahead equals the plan made in place for the same inputs (digest), also when the
  driver's hardware changes while the thread plans (the calibration's fit at the step's end):
  the thread plans with the hardware it was started with.
* A plan made for other inputs is not used; a planner error is raised where the plan is taken.
* The thread is joined when its plan is taken and by `StepDriver.close`.
* 2 ranks on gloo: the same losses with plan-ahead on as off, with plans made ahead.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distributed import run_distributed
from megatron_dcp.config import DCPConfig, DCPConfigError
from megatron_dcp.plan.presets import MODEL_PRESETS
from megatron_dcp.plan.workload import sample_lengths
from megatron_dcp.runtime.step import StepDriver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

WORLD = 16
LENGTHS = sample_lengths("long", 65536 * WORLD, seed=1)


def _driver(**config) -> StepDriver:
    pool = SimpleNamespace(rank=0, world_size=WORLD, job_group=None)
    return StepDriver(DCPConfig(enabled=True, **config), pool=pool, hardware="h200",
                      model_shape=MODEL_PRESETS["llama-7b"])


def _plan_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dcp-plan-ahead"]


def test_plan_made_ahead_equals_plan_made_in_place():
    driver = _driver()
    driver.iteration = 3
    assert driver.plan_ahead(LENGTHS)
    plan, plan_s, wait_s = driver.timed_plan(LENGTHS)
    assert plan.meta["made_ahead"] and plan_s > 0 and 0 <= wait_s <= plan_s + 0.05
    assert plan.digest() == driver.plan(LENGTHS, 3).digest()
    assert not _plan_threads()


def test_the_thread_plans_with_the_hardware_it_was_started_with():
    """The driver's hardware changes (a calibration fit) while the thread has not yet planned:
    the plan is still the one of the hardware at the start, the same on every rank."""
    driver = _driver()
    start = driver.hardware
    later = dataclasses.replace(start, inter_bandwidth=start.inter_bandwidth / 50,
                                attention_flops=start.attention_flops / 3)
    assert driver.plan(LENGTHS, 0, hardware=later).digest() != \
        driver.plan(LENGTHS, 0, hardware=start).digest()  # the change matters to the plan
    go, plan = threading.Event(), driver.plan

    def held_plan(*args, **kwargs):
        go.wait(30)
        return plan(*args, **kwargs)

    driver.plan = held_plan
    driver.plan_ahead(LENGTHS)
    driver.hardware = later  # the fit at the end of the step, before the thread plans
    go.set()
    made = driver.timed_plan(LENGTHS)[0]
    assert made.meta["made_ahead"] and made.digest() == plan(LENGTHS, 0, hardware=start).digest()


def test_a_plan_for_other_inputs_is_not_used_and_errors_surface_when_taken():
    driver = _driver()
    driver.plan_ahead(LENGTHS, iteration=1)  # made for the next iteration, not this one
    plan, plan_s, wait_s = driver.timed_plan(LENGTHS)
    assert "made_ahead" not in plan.meta and plan_s == wait_s > 0 and plan.meta["iteration"] == 0
    driver.plan_ahead(LENGTHS[:-1])
    assert "made_ahead" not in driver.timed_plan(LENGTHS)[0].meta
    driver.plan_ahead([WORLD * 10**7])  # fits nowhere: the planner's error, at the next step
    with pytest.raises(Exception, match="fit|memory"):
        driver.timed_plan([WORLD * 10**7])
    assert not _plan_threads()


def test_off_plain_and_close():
    assert not _driver(plan_ahead="off").plan_ahead(LENGTHS)
    assert not StepDriver(DCPConfig(), pool=SimpleNamespace(rank=0, world_size=2)).plan_ahead(
        [5, 6])
    with pytest.raises(DCPConfigError, match="plan_ahead"):
        DCPConfig(plan_ahead="no")
    assert DCPConfig.from_dict({"plan_ahead": "off"}).plan_ahead == "off"
    driver = _driver()
    driver.plan_ahead(LENGTHS)
    driver.close()  # joined, the plan dropped
    assert not _plan_threads() and not driver._ahead.pending


def test_sampler_peek_is_the_next_batch():
    from megatron_dcp.data import GlobalBatchSampler

    sampler = GlobalBatchSampler([5, 9, 30, 7, 12, 3] * 3, 40, seed=2)
    for _ in range(6):  # crosses epochs
        peeked = sampler.peek_batch()
        assert sampler.peek_batch() == peeked == sampler.next_batch()


BATCHES = [(29, 7, 13, 18, 3, 22), (40, 5, 11), (9, 31, 17, 6, 20)]


def _train(rank, world_size, plan_ahead):
    """Three SGD steps of the tiny decoder, each passing the next batch's lengths."""
    from executor_cases import DECODER, build_model, make_batch
    from plain_torch import TorchEngine

    from megatron_dcp.runtime.groups import GroupPool

    pool = GroupPool()
    model = build_model("decoder")
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.5))
    engine.group = pool.world_group
    config = DCPConfig(enabled=True, plan_ahead=plan_ahead, liveness_interval_s=0)
    driver = StepDriver(config, pool=pool, model_shape=model.shape())
    out = []
    for i, lengths in enumerate(BATCHES):
        upcoming = BATCHES[i + 1] if i + 1 < len(BATCHES) else None
        result = driver.step(engine, make_batch(lengths, DECODER["vocab_size"]),
                             next_lengths=upcoming)
        out.append((result.loss, bool(result.plan.meta.get("made_ahead")), result.plan_s,
                    result.plan_wait_s))
    driver.close()
    return out, [t.name for t in threading.enumerate()]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_ranks_same_losses_with_plan_ahead_on_and_off():
    on = run_distributed(_train, world_size=2, args=("on",), timeout_s=180)
    off = run_distributed(_train, world_size=2, args=("off",), timeout_s=180)
    for (steps_on, threads), (steps_off, _) in zip(on, off):
        assert [s[1] for s in steps_on] == [False, True, True]  # steps 2, 3: made ahead
        assert not any(s[1] for s in steps_off)
        for a, b in zip(steps_on, steps_off):
            assert abs(a[0] - b[0]) <= 1e-5 * abs(b[0]), (steps_on, steps_off)
        assert all(s[3] <= s[2] + 0.05 for s in steps_on)
        assert "dcp-plan-ahead" not in threads
