"""The step driver on lockstep plans: every rank runs every slot (its task, or an empty task of
the slot's recompute depth), so all ranks call the same modules in the same order: what ZeRO-3's
per-module all-gathers need. Gradients still match a one-rank reference.

The module order is recorded with forward pre-hooks on every submodule (a recompute calls them
again). The same tasks as a free plan (no slots) give different orders on different ranks: the
negative control that shows the comparison can fail.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from executor_cases import DECODER, build_model, make_batch, plan_dict, reference, rel_err, task

pytestmark = pytest.mark.slow  # every test here launches processes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

LENGTHS = (29, 7, 13, 18, 3, 22)
TOL = 1e-5


def _slotted(tasks, slots):
    return [replace(t, slot=k, start=float(k)) for t, k in zip(tasks, slots)]


# world 2: Ulysses 2, then rank 0 alone (rank 1 empty, recomputing 1 layer), ring 2,
# rank 1 alone (3 layers)
TASKS_2 = [task(0, (0, 1), (0,), ulysses=2, recompute_layers=2),
           task(1, (0,), (1, 2), recompute_layers=1),
           task(2, (1, 0), (3, 4), recompute_layers=0), task(3, (1,), (5,), recompute_layers=3)]
SLOTS_2 = [0, 1, 2, 3]
# world 4: hybrid 2 x 2, then ring 3 beside an empty rank 3 (1 recomputed layer), then two
# single-rank tasks beside two empty ranks (no recompute)
TASKS_4 = [task(0, (0, 1, 2, 3), (0, 5), ulysses=2, recompute_layers=2),
           task(1, (2, 1, 0), (3,), recompute_layers=1),
           task(2, (0,), (1, 2), recompute_layers=0), task(3, (1,), (4,), recompute_layers=0)]
SLOTS_4 = [0, 1, 2, 2]


def _body(rank, world_size, plan):
    from plain_torch import TorchEngine

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    model = build_model("decoder")
    calls: list[str] = []
    for name, module in model.named_modules():
        if name:
            module.register_forward_pre_hook(lambda m, args, name=name: calls.append(name))
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.0))
    pool = GroupPool()
    engine.group = pool.world_group
    driver = StepDriver(DCPConfig(enabled=True), pool=pool, model_shape=model.shape())
    result = driver.step(engine, make_batch(LENGTHS, DECODER["vocab_size"]),
                         Plan.from_dict(plan))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return result.loss, grads, result.micro_steps, result.empty_micro_steps, calls


@pytest.fixture(scope="module")
def ref():
    return reference("decoder", LENGTHS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size, tasks, slots", [(2, TASKS_2, SLOTS_2),
                                                      (4, TASKS_4, SLOTS_4)], ids=["w2", "w4"])
def test_lockstep_ranks_call_the_same_modules_and_match_the_reference(ref, world_size, tasks,
                                                                      slots):
    plan = plan_dict(_slotted(tasks, slots), LENGTHS, world_size)
    results = run_distributed(_body, world_size=world_size, args=(plan,), timeout_s=200)
    ref_loss, ref_grads = ref
    for loss, grads, micro, empty, _ in results:
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
        assert max(rel_err(grads[n], g) for n, g in ref_grads.items()) <= TOL
        assert micro == max(slots) + 1  # every rank runs every slot
    mine = [sum(1 for t in tasks if r in t.ranks) for r in range(world_size)]
    assert [r[3] for r in results] == [max(slots) + 1 - m for m in mine]
    first = results[0][4]
    assert all(r[4] == first for r in results[1:]), "ranks called modules in different orders"
    # recompute shows: more module calls than one forward per slot
    layer_calls = sum(1 for name in first if name == "layers.0")
    assert layer_calls > max(slots) + 1


@pytest.mark.timeout(240)
def test_negative_control_free_plan_calls_differ_across_ranks():
    plan = plan_dict([replace(t, start=float(k)) for t, k in zip(TASKS_2, SLOTS_2)], LENGTHS, 2)
    results = run_distributed(_body, world_size=2, args=(plan,), timeout_s=200)
    assert results[0][4] != results[1][4]
