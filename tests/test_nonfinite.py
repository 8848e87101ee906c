"""A non-finite loss stops the step before its update (naming iteration, rank and task), or
with ``skip_nonfinite`` skips it without an update (issue 22, item 2).

Two ranks on gloo run `StepDriver` with the plain-torch engine on a fixed plan; one token's
embedding row is ``nan`` and only sequence 1 (task 2, rank 0 alone) holds that token.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from distributed import DistributedError, run_distributed
from executor_cases import DECODER, build_model, plan_dict, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

LENGTHS = (29, 7, 13, 18, 3, 22)
PLAN = plan_dict([task(0, (0, 1), (0,), ulysses=2, start=0.0),
                  task(1, (1, 0), (3, 4), start=1.0),
                  task(2, (0,), (1, 2), start=2.0),
                  task(3, (0,), (5,), start=3.0)], LENGTHS, 2)
POISON = DECODER["vocab_size"] - 1


def _batch(poisoned: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, POISON, (n,), generator=gen) for n in LENGTHS]
    if poisoned:
        batch[1][3] = POISON
    return batch


def _body(rank, world_size, skip):
    from plain_torch import TorchEngine

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    model = build_model("decoder")
    with torch.no_grad():
        model.embed.weight[POISON] = float("nan")
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    pool = GroupPool()
    engine.group = pool.world_group
    driver = StepDriver(DCPConfig(enabled=True, skip_nonfinite=skip), pool=pool,
                        model_shape=model.shape())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = Plan.from_dict(PLAN)
    bad = driver.step(engine, _batch(True), plan)
    same = lambda: all(torch.allclose(p, before[n], rtol=0, atol=0, equal_nan=True)  # noqa: E731
                       for n, p in model.named_parameters())
    unchanged = same()
    good = driver.step(engine, _batch(False), plan)
    changed = not same()
    return bad.skipped, bad.loss, unchanged, good.skipped, good.loss, changed, driver.iteration


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_nonfinite_loss_stops_before_the_update_naming_iteration_rank_and_task():
    with pytest.raises(DistributedError) as err:
        run_distributed(_body, world_size=2, args=(False,), timeout_s=100)
    text = str(err.value)
    assert "NonFiniteStepError" in text and "iteration 1: loss nan is not finite" in text
    assert "rank 0 (task 2)" in text and "--dcp-skip-nonfinite" in text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_skip_nonfinite_skips_the_update_and_trains_on():
    results = run_distributed(_body, world_size=2, args=(True,), timeout_s=100)
    for skipped, loss, unchanged, good_skipped, good_loss, changed, iteration in results:
        assert skipped and loss != loss  # nan
        assert unchanged  # no update from the skipped step
        assert not good_skipped and good_loss == good_loss and changed
        assert iteration == 2


def test_check_step_decides_alike_for_loss_and_gradient_norm():
    from megatron_dcp.runtime.nonfinite import NonFiniteStepError, check_step

    assert check_step(3, 1.5, 2.0, skip=False) is False
    assert check_step(3, float("inf"), skip=True) is True
    with pytest.raises(NonFiniteStepError, match="iteration 4: gradient norm nan"):
        check_step(4, 1.0, float("nan"), skip=False, where="rank 1")


def test_skip_flag_in_both_flag_styles_and_json():
    import argparse

    from megatron_dcp.config import DCPConfig

    for style, flag in (("deepspeed", "--dcp_skip_nonfinite"),
                        ("megatron", "--dcp-skip-nonfinite")):
        p = DCPConfig.add_arguments(argparse.ArgumentParser(), style=style)
        assert DCPConfig.from_args(p.parse_args([flag]), style=style).skip_nonfinite  # no --dcp
        assert not DCPConfig.from_args(p.parse_args([]), style=style).skip_nonfinite
    assert DCPConfig.from_dict({"skip_nonfinite": True}).skip_nonfinite


def _megatron_body(rank, world_size, skip):
    """One DCP step of a tiny Megatron GPT at DP 2 (tests/test_megatron_pipeline's model,
    one stage) whose gradient of one weight is ``nan`` on rank 1 only (the loss is finite),
    then the example's optimizer step unless the step was skipped: (what happened, weights
    unchanged)."""
    from functools import partial

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from test_megatron_pipeline import _build, _sequences

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch
    from megatron_dcp.plan.plan import Plan, Task
    from megatron_dcp.runtime.nonfinite import NonFiniteStepError

    (model,) = _build(1, dcp=True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), module=model)
    ddp.zero_grad_buffer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    weight = next(p for n, p in model.named_parameters() if "linear_fc1" in n)
    if rank == 1:
        weight.register_hook(lambda g: g * float("nan"))

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"],
                    packed_seq_params=b["packed_seq_params"])
        mask = b["loss_mask"]
        return out, partial(lambda m, o: ((o.view(-1) * m.view(-1)).sum(), m.sum().int(),
                                          {"lm loss": torch.zeros(2)}), mask)

    sequences = _sequences()
    plan = Plan(tasks=(Task(id=0, ranks=(0,), seqs=(0, 1, 2)),
                       Task(id=1, ranks=(1,), seqs=(3, 4, 5))),
                lengths=tuple(int(s.numel()) for s in sequences), world_size=2, policy="test")
    step = DCPForwardBackward(DCPConfig(enabled=True, calibration="off", skip_nonfinite=skip))
    try:
        result = step(forward_step_func=forward_step, model=[ddp], num_microbatches=1,
                      data_iterator=iter([GlobalBatch(sequences, plan)]), seq_length=0,
                      micro_batch_size=1).result
        outcome = ("skipped" if result.skipped else "trained", result.loss)
        if not result.skipped:  # the example's loop: Megatron's step leaves the update to it
            for p in model.parameters():
                p.grad = p.main_grad
            optimizer.step()
    except NonFiniteStepError as err:
        outcome = ("stopped", str(err))
    destroy_model_parallel()
    return outcome, all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("skip", [False, True], ids=["stop", "skip"])
def test_megatron_nonfinite_gradient_norm_stops_or_skips_before_the_update(skip):
    """A finite loss with a ``nan`` gradient on one rank: every rank stops (naming the
    iteration and rank 1) or, with skip_nonfinite, skips the step; no rank's weights change."""
    results = run_distributed(_megatron_body, world_size=2, args=(skip,), timeout_s=100)
    for (kind, detail), unchanged in results:
        assert unchanged
        if skip:
            assert kind == "skipped", detail
        else:
            assert kind == "stopped" and "iteration 1: gradient norm nan" in detail \
                and "rank 1" in detail and "rank 0" not in detail, detail


# ---------------------------------------------------------------------- steps that train nothing
def _empty_body(rank, world_size):
    """Issue 59: a batch whose every sequence the oversize policy ``skip`` leaves out (longer
    than the model's 64 positions), then an ordinary one, under AdamW with weight decay and a
    learning-rate schedule: (per step: skipped, empty, weights unchanged, optimizer steps and
    scheduler epoch after it; the run check's message after the empty step, after both)."""
    from plain_torch import TorchEngine

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.nonfinite import NothingTrainedError
    from megatron_dcp.runtime.step import StepDriver

    class Engine(TorchEngine):
        def finish(self):
            super().finish()
            self.scheduler.step()

    model = build_model("decoder")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    engine = Engine(model, optimizer)
    engine.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))
    pool = GroupPool()
    engine.group = pool.world_group
    driver = StepDriver(DCPConfig(enabled=True, oversize="skip", calibration="off"), pool=pool,
                        model_shape=model.shape())
    gen = torch.Generator().manual_seed(5)
    out = []

    def run_check():
        try:
            driver.tally.check()
            return None
        except NothingTrainedError as exc:
            return str(exc)

    checks = []
    for lengths in ((70, 80, 90), (29, 13, 70)):
        before = [p.detach().clone() for p in model.parameters()]
        batch = [torch.randint(0, DECODER["vocab_size"], (n,), generator=gen) for n in lengths]
        result = driver.step(engine, batch)
        steps = [int(s["step"]) for s in optimizer.state.values()]
        out.append((result.skipped, result.empty,
                    all(torch.equal(p, b) for p, b in zip(model.parameters(), before)),
                    max(steps, default=0), engine.scheduler.last_epoch))
        checks.append(run_check())
    return out, checks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_step_with_no_trained_token_is_skipped_before_the_optimizer():
    """Every sequence skipped: the step is reported skipped (``empty``), the weights stay
    bit-identical under weight decay, AdamW's step count and the schedule do not advance; a
    run of only such steps ends with a message; a later step trains as usual."""
    for (empty, trained), checks in run_distributed(_empty_body, world_size=2, timeout_s=100):
        assert empty == (True, True, True, 0, 0), empty
        assert trained[:3] == (False, False, False) and trained[3:] == (1, 1), trained
        assert checks[1] is None
        assert checks[0].startswith("error: no step trained a token: every sequence was "
                                    "skipped by --dcp-oversize skip (3 sequences in 1 steps")


def test_check_trained_names_the_cause():
    from megatron_dcp.runtime.nonfinite import NothingTrainedError, check_trained, trains_nothing

    check_trained(0, 0)  # no step ran: nothing to say
    check_trained(3, 1, left_out=5)
    with pytest.raises(NothingTrainedError, match="had a next-token target") as err:
        check_trained(2, 0)
    assert err.value.code.startswith("error: no step trained a token")  # exit status 1
    assert trains_nothing(0) and not trains_nothing(1)
