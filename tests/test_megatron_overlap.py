"""Megatron DDP's two overlaps under `DCPForwardBackward` (issue 56, items 1 and 2), with
Megatron's distributed optimizer, on 2 ranks (megatron-core 0.16 and 0.19 alike).

Four training steps: one where rank 1 has no task (an empty micro-step), two where the ranks run
different numbers of tasks (rank 0 four, rank 1 two; Ulysses, ring, recompute), and the first
plan again. With ``overlap_grad_reduce`` + ``overlap_param_gather`` (buckets of 2,000 elements:
several bucket groups) the losses and the parameters after every update equal those of the same
steps without the overlaps; from the third step the bucket groups start inside each rank's last
backward (the second step learned that shape); no rank hangs; a skipped step leaves no reduction
in flight. Before, ``overlap_param_gather`` was refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.slow

STEPS = ("idle", "uneven", "uneven", "idle")


def _train(rank, world_size, overlaps: bool, nan_step=None):
    """The four steps; returns (losses, buckets started early per step, final parameters).
    ``nan_step``: that step's loss is ``nan`` on rank 0 and the step is skipped
    (``skip_nonfinite``: no optimizer step)."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_cases import forward_step
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch
    from megatron_dcp.plan.plan import Plan
    from test_megatron import PLAN_2, _build, _plan, _sequences

    plans = {"idle": Plan.from_dict(_plan(2, [dict(ranks=(0,), seqs=tuple(range(7)))])),
             "uneven": Plan.from_dict(PLAN_2)}
    try:
        model = _build(1, dcp=True)  # the CPU patches (Megatron's optimizer among them)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=overlaps,
            overlap_param_gather=overlaps, bucket_size=2000), module=model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-2, clip_grad=0.0, params_dtype=torch.float32,
            use_distributed_optimizer=True), [ddp])
        step = DCPForwardBackward(DCPConfig(enabled=True, skip_nonfinite=True))
        losses, early = [], []
        for i, name in enumerate(STEPS):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            poison = i == nan_step and rank == 0

            def forward(data_iterator, model):
                out, loss_func = forward_step(data_iterator, model)
                return (out * float("nan") if poison else out), loss_func

            result = step(forward_step_func=forward, data_iterator=iter(
                [GlobalBatch(_sequences(), plans[name])]), model=[ddp], num_microbatches=1,
                seq_length=0, micro_batch_size=1).result
            if result.skipped != (i == nan_step):
                raise AssertionError(f"step {i}: skipped {result.skipped}")
            if not result.skipped:
                optimizer.step()
            losses.append(result.loss)
            reduction = next(iter(step._reductions.values()))
            early.append((reduction.early, reduction.buckets) if reduction else None)
        ddp.start_param_sync(force_sync=True)  # the last update's gathers
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        dist.barrier()
    finally:
        destroy_model_parallel()
    return losses, early, params


def _both(rank, world_size):
    return [(_train(rank, world_size, False, nan), _train(rank, world_size, True, nan))
            for nan in (None, 2)]


@pytest.mark.timeout(400)
def test_both_overlaps_under_dcp_equal_the_steps_without_them():
    """Also with a skipped step (a ``nan`` loss on rank 0 in the third step, whose bucket groups
    start inside the last backward; ``skip_nonfinite``): the reductions started are finished on
    every rank, and the next step runs and equals the one without the overlaps."""
    launched = run_distributed(_both, world_size=2, timeout_s=380)
    for rank, ((losses, _, params), (o_losses, _, o_params)) in (
            (rank, pair) for rank, runs in enumerate(launched) for pair in runs):
        for a, b in zip(o_losses, losses):
            assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-6 * abs(b), \
                (rank, o_losses, losses)
        for name, p in params.items():
            assert torch.allclose(o_params[name], p, rtol=1e-6, atol=1e-7), (rank, name)
    results = [runs[0] for runs in launched]
    for rank, (_, (o_losses, early, o_params)) in enumerate(results):
        buckets = early[0][1]
        assert buckets >= 3, early  # several bucket groups
        assert early[0][0] == 0 and early[1][0] == 0, early  # shapes not yet learned
        # in the last backward, all of them (the last one when its final gradient accumulates)
        assert early[2] == early[3] == (buckets, buckets), early
    assert len(set(results[0][0][0])) == len(STEPS)  # the steps train
