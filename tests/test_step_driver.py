"""The engine-neutral step driver, with backward on a fresh thread as CUDA's autograd runs it.

Every run is compared with a one-rank reference that shares no reduction code with the driver
(`executor_cases.reference`: each sequence alone, summed token losses / T, one backward).
The engine is the plain-torch example (`examples/plain_torch.py`), so the test also shows that
the driver's protocol alone is enough for a new engine.

Modes of a run (all modes of one world size share one launch, each reported on its own):
* ``"same-thread"``: backward in the calling thread (what CPU autograd does);
* ``"thread"``: every backward on a fresh thread, where the caller's context variables are not
  visible; the model gets its task as an argument only;
* ``"thread-reentrant-no-task"``: a model that neither takes the task nor uses `run_layer`
  (torch's reentrant checkpoint, which re-runs forward in backward): the negative control, which
  must come out wrong (the check can fail);
* ``"plain"``: DCP off, plain data parallel through the same driver (backward on a fresh thread).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from executor_cases import (DECODER, build_model, make_batch, on_fresh_thread, plan_dict, reference,
                            rel_err, task)

pytestmark = pytest.mark.slow  # every test here launches processes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

LENGTHS = (29, 7, 13, 18, 3, 22)
TOL = 1e-5

# world 2: Ulysses 2 and ring 2 (reversed ranks) with recompute, packed singles, uneven counts
PLAN_2 = plan_dict([task(0, (0, 1), (0,), ulysses=2, recompute_layers=2, start=0.0),
                    task(1, (1, 0), (3, 4), ulysses=1, recompute_layers=3, start=1.0),
                    task(2, (0,), (1, 2), recompute_layers=1, start=2.0),
                    task(3, (0,), (5,), recompute_layers=0, start=3.0)], LENGTHS, 2)
# world 4: hybrid 2 x 2 with recompute, ring 3, an idle rank 3 after its first task
PLAN_4 = plan_dict([task(0, (0, 1, 2, 3), (0, 5), ulysses=2, recompute_layers=2, start=0.0),
                    task(1, (2, 1, 0), (3,), ulysses=1, recompute_layers=1, start=1.0),
                    task(2, (0,), (1, 2), recompute_layers=3, start=2.0),
                    task(3, (1,), (4,), recompute_layers=0, start=2.0)], LENGTHS, 4)


def _reentrant_no_task(model) -> None:
    """Make the decoder call its layers through torch's reentrant checkpoint, without a task
    (a user model that knows nothing of DCP)."""
    import torch.utils.checkpoint as cp

    def forward(input_ids, position_ids=None, task=None):
        from megatron_dcp.models.common import rope_tables

        x = model.embed(input_ids)
        cos, sin = rope_tables(position_ids, model.config.head_dim, model.config.rope_theta,
                               x.dtype)
        for layer in model.layers:
            x = cp.checkpoint(layer, x, cos, sin, use_reentrant=True)
        return torch.nn.functional.linear(model.norm(x), model.lm_head.weight)

    model.forward = forward


def _run(pool, model, plan, mode):
    from plain_torch import TorchEngine

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.step import StepDriver

    if mode == "thread-reentrant-no-task":
        _reentrant_no_task(model)
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.0))
    if mode != "same-thread":
        engine.backward = lambda loss, last: on_fresh_thread(loss.backward)
    engine.group = pool.world_group
    enabled = mode != "plain"
    driver = StepDriver(DCPConfig(enabled=enabled), pool=pool, model_shape=model.shape())
    batch = make_batch(LENGTHS, DECODER["vocab_size"])
    result = driver.step(engine, batch, Plan.from_dict(plan) if enabled else None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return result.loss, grads, result.micro_steps, result.empty_micro_steps


def _body(rank, world_size, plan, modes):
    """Every mode in turn on this rank: {mode: (loss, grads, micro-steps, empty) or the
    traceback text of its failure}."""
    import traceback

    from megatron_dcp.runtime.groups import GroupPool

    pool = GroupPool()
    out = {}
    for mode in modes:
        try:
            out[mode] = _run(pool, build_model("decoder"), plan, mode)
        except Exception:  # noqa: BLE001 - reported per mode by the test of that mode
            out[mode] = traceback.format_exc()
    return out


MODES = {1: ("plain",), 2: ("same-thread", "thread", "thread-reentrant-no-task", "plain"),
         4: ("same-thread", "thread", "plain")}
PLANS = {1: None, 2: PLAN_2, 4: PLAN_4}
_LAUNCHES: dict = {}


def _results(world_size, mode):
    """Per rank, the result of ``mode`` in the one launch of ``world_size`` (run on first use)."""
    if world_size not in _LAUNCHES:
        _LAUNCHES[world_size] = run_distributed(
            _body, world_size=world_size, args=(PLANS[world_size], MODES[world_size]),
            timeout_s=280)
    results = [r[mode] for r in _LAUNCHES[world_size]]
    failed = [(rank, r) for rank, r in enumerate(results) if isinstance(r, str)]
    if failed:
        pytest.fail(f"mode {mode!r}, rank {failed[0][0]} failed:\n{failed[0][1]}")
    return results


@pytest.fixture(scope="module")
def ref():
    return reference("decoder", LENGTHS)


def _errors(results, ref):
    ref_loss, ref_grads = ref
    worst = 0.0
    for loss, grads, _, _ in results:
        worst = max(worst, abs(loss - ref_loss) / abs(ref_loss))
        worst = max(worst, max(rel_err(grads[n], g) for n, g in ref_grads.items()))
    return worst


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4], ids=["w2", "w4"])
@pytest.mark.parametrize("mode", ["same-thread", "thread"])
def test_driver_matches_one_rank_reference(ref, world_size, mode):
    assert _errors(_results(world_size, mode), ref) <= TOL


@pytest.mark.timeout(300)
def test_negative_control_reentrant_recompute_without_task_is_wrong(ref):
    """Without the task (no argument, so none on the autograd thread) a recompute attends
    as if outside a task: the comparison above must be able to see that."""
    assert _errors(_results(2, "thread-reentrant-no-task"), ref) > 1e-3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_plain_data_parallel_is_the_driver_with_a_trivial_plan(ref, world_size):
    results = _results(world_size, "plain")
    assert _errors(results, ref) <= TOL
    # equal_micro_steps is False for this engine: every rank runs its own sequences only
    counts = [r[2] for r in results]
    expected = [max(len(LENGTHS[r::world_size]), 1) for r in range(world_size)]
    assert counts == expected


# ---------------------------------------------------------------------- oversize truncate
TRUNC_LENGTHS = (70, 29, 13, 18)  # the first is longer than the decoder's 64 positions


def _truncate_body(rank, world_size):
    """Issue 59: the driver plans a batch with ``oversize="truncate"`` (sequence 0 is cut to
    the model's 64 positions) and runs it: (loss, reduced gradients, truncated sequences and
    tokens)."""
    from plain_torch import TorchEngine

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    model = build_model("decoder")
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.0))
    pool = GroupPool()
    engine.group = pool.world_group
    driver = StepDriver(DCPConfig(enabled=True, oversize="truncate", calibration="off"),
                        pool=pool, model_shape=model.shape())
    result = driver.step(engine, make_batch(TRUNC_LENGTHS, DECODER["vocab_size"]))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return (result.loss, grads, result.truncated_sequences, result.truncated_tokens,
            result.plan.lengths)


def test_oversize_truncate_trains_the_kept_prefix_exactly():
    """The batch is cut as the plan says (a prefix of 64 tokens: its own next-token targets,
    the last token without one) and the step equals one process training on the truncated
    sequences; the cut tokens are counted."""
    model = build_model("decoder")
    batch = make_batch(TRUNC_LENGTHS, DECODER["vocab_size"])
    batch[0] = batch[0][:64]
    total = sum(int(s.numel()) - 1 for s in batch)
    loss = sum(model.loss(s, None, torch.cat([s[1:], torch.tensor([-100])])) / total
               for s in batch)
    loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    for got_loss, grads, cut_seqs, cut_tokens, lengths in run_distributed(
            _truncate_body, world_size=2, timeout_s=100):
        assert lengths == (64, 29, 13, 18) and (cut_seqs, cut_tokens) == (1, 6)
        assert abs(got_loss - float(loss)) <= TOL * abs(float(loss))
        assert max(rel_err(grads[n], g) for n, g in ref_grads.items()) <= TOL
