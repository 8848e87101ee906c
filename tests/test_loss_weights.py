"""Per-token loss masks, weights and scales (issue 57): a `WeightedBatch` trains exactly what one
device computes on the whole batch, under every loss normalisation (RL trainers' four modes),
whatever the plan (degrees 1-4: Ulysses, ring, hybrid, ranks without a task, MLP and loss tiles,
an offloaded layer input), and through the
lengths-first input stage (labels, weights and scales travel with the tokens; a truncated
document's figures are its kept prefix's). Real gloo processes at 1, 2 and 4 ranks against a
single-process reference written from the modes' definitions (verl's ``loss_agg_mode``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from distributed import run_distributed
from executor_cases import build_model, make_batch, plan_dict, rel_err, shard_loss, task
from megatron_dcp.runtime.targets import LossWeights, WeightedBatch, target_weights

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LENGTHS = (9, 17, 5, 30, 12, 2, 23, 14)


def _targets(lengths, seed: int = 3, scales: bool = True):
    """Per sequence: labels (next tokens, some ids replaced: SFT-style given targets), a mask
    with a masked prompt and holes, float weights on one sequence, and per-token or
    per-sequence scales (advantages, negative ones too). Sequence 5 trains nothing."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(lengths, 48)
    labels, weights, scale = [], [], []
    for s, (ids, n) in enumerate(zip(batch, lengths)):
        label = torch.cat([ids[1:], torch.tensor([-100])])
        label[::5] = torch.randint(0, 48, label[::5].shape, generator=gen)
        label[-1] = -100
        w = (torch.rand(n, generator=gen) > 0.3).double()
        w[:n // 3] = 0.0  # a prompt
        if s == 3:
            w = w * torch.rand(n, generator=gen, dtype=torch.float64) * 2
        if s == 5:
            w[:] = 0.0
        labels.append(label)
        weights.append(w)
        scale.append(torch.randn(n, generator=gen, dtype=torch.float64) if s % 2
                     else float(torch.randn((), generator=gen)))
    return batch, labels, weights, (scale if scales else None)


def _reference(lengths, mode, norm=None, cut=None, scaled=True):
    """Loss and gradients on one process from the modes' formulas (``cut``: sequence -> kept
    tokens, the truncated prefix keeping its targets)."""
    model = build_model("decoder")
    batch, labels, weights, scales = _targets(lengths)
    scales = scales if scaled else [1.0] * len(batch)
    terms, sums = [], []
    for s, ids in enumerate(batch):
        n = (cut or {}).get(s, len(ids))
        label, w = labels[s][:n].clone(), weights[s][:n].clone()
        w[label == -100] = 0.0
        label[w == 0] = -100
        c = scales[s] if isinstance(scales[s], float) else scales[s][:n]
        ce = model.loss(ids[:n], None, label, reduction="none").double()
        terms.append((ce * w * c).sum())
        sums.append(float(w.sum()))
    count = sum(1 for w in sums if w)
    if mode == "token-mean":
        loss = sum(terms) / sum(sums)
    elif mode == "seq-mean-token-mean":
        loss = sum(t / w for t, w in zip(terms, sums) if w) / count
    elif mode == "seq-mean-token-sum":
        loss = sum(t for t, w in zip(terms, sums) if w) / count
    else:
        loss = sum(terms) / (norm or max((cut or {}).get(s, n) for s, n in enumerate(lengths)))
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def _plans(world: int) -> list[dict]:
    """Hand-built plans mixing degrees and layouts (Ulysses, ring, hybrid), packed tasks,
    recompute, uneven task counts and (at 4) a rank without a task."""
    L = LENGTHS
    if world == 1:
        return [plan_dict([task(0, [0], [0, 1, 2], recompute_layers=1),
                           task(1, [0], [3, 4, 5, 6, 7], start=0.1)], L, 1)]
    if world == 2:  # task 2 tiles its MLP and loss and offloads a recomputed layer's input
        long = replace(task(2, [0], [0, 2, 5], start=0.2, recompute_layers=2), mlp_tiles=2,
                       loss_tiles=3, offload_layers=1)
        return [plan_dict([task(0, [0, 1], [3], ulysses=2), task(1, [0, 1], [6, 1], ulysses=1,
                                                                 start=0.1),
                           long, task(3, [1], [4, 7], start=0.2)], L, 2)]
    return [plan_dict([task(0, [0, 1, 2, 3], [3], ulysses=2), task(1, [0, 1, 2], [6, 1],
                                                                   ulysses=1, start=0.1),
                       task(2, [0, 1], [4, 7], ulysses=2, start=0.2),
                       task(3, [2], [0, 2, 5], start=0.2, recompute_layers=1)], L, 4)]


def _run(rank: int, world: int, modes, stage: bool, scaled: bool = True):
    import torch.distributed as dist

    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime import input_stage
    from megatron_dcp.runtime.executor import reduce_gradients, run_plan
    from megatron_dcp.runtime.groups import GroupPool

    pool = GroupPool()
    out = {}
    for mode in modes:
        plan = Plan.from_dict(_plans(world)[0])
        model = build_model("decoder")
        batch, labels, weights, scales = _targets(plan.lengths, scales=scaled)
        scales = scales or [None] * len(batch)
        if stage:  # each rank the source of a contiguous share; document 0 truncated to 7
            share = input_stage.share_of(len(batch), rank, world)
            local = WeightedBatch([batch[i] for i in share], [labels[i] for i in share],
                                  [weights[i] for i in share], [scales[i] for i in share])
            cut = Plan.from_dict({**plan.to_dict(), "lengths": [
                7 if i == 0 else n for i, n in enumerate(plan.lengths)]})
            cut.meta["truncated"] = [[0, plan.lengths[0]]]
            staged = input_stage.global_batch(local, rank, "", lambda lengths: cut)
            plan, sequences = staged.plan, staged.sequences
            out["held"] = [s is not None for s in sequences]
        else:
            sequences = WeightedBatch(batch, labels, weights, scales)
        stats = run_plan(plan, sequences, rank, shard_loss(model, "none"), pool=pool,
                         loss_reduction=mode, max_position=model.config.max_position)
        reduce_gradients(list(model.parameters()), pool.world_group)
        out[mode] = (stats.loss, stats.tokens,
                     {n: p.grad.clone() for n, p in model.named_parameters()})
    dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_mode_is_exact_under_any_plan(world):
    results = run_distributed(_run, world, args=(MODES, False))
    for mode in MODES:
        ref_loss, ref_grads = _reference(LENGTHS, mode)
        for rank, res in enumerate(results):
            loss, tokens, grads = res[mode]
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (mode, rank, loss, ref_loss)
            for name, g in ref_grads.items():
                assert rel_err(grads[name], g) <= 1e-6, (mode, rank, name)
        _, labels, weights, _ = _targets(LENGTHS)
        trained = sum(int(((w != 0) & (lab != -100)).sum()) for lab, w in zip(labels, weights))
        assert results[0][mode][1] == trained < sum(LENGTHS)  # tokens trained, not run


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, scaled", [(2, True), (4, True), (2, False)])
def test_weights_travel_through_the_lengths_first_stage(world, scaled):
    modes = ("token-mean", "seq-mean-token-mean")
    results = run_distributed(_run, world, args=(modes, True, scaled))
    for mode in modes:
        ref_loss, ref_grads = _reference(LENGTHS, mode, cut={0: 7}, scaled=scaled)
        for rank, res in enumerate(results):
            loss, _, grads = res[mode]
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (mode, rank, loss, ref_loss)
            for name, g in ref_grads.items():
                assert rel_err(grads[name], g) <= 1e-6, (mode, rank, name)
    assert not all(all(r["held"]) for r in results)  # lengths first: not every rank holds all


def test_defaults_are_the_plain_batch_and_the_factors_the_modes():
    from megatron_dcp.plan.plan import Plan

    batch = make_batch((5, 1, 3), 48)
    plan = Plan.from_dict(plan_dict([task(0, [0], [0, 1, 2])], (5, 1, 3), 1))
    plain, weighted = LossWeights(plan, batch), LossWeights(plan, WeightedBatch(batch))
    assert plain.factor == weighted.factor and plain.total == weighted.total == 6
    assert not weighted.per_token and weighted.trained == 6
    for a, b in zip(plain.packed(plan.tasks[0], batch), weighted.packed(plan.tasks[0],
                                                                        WeightedBatch(batch))):
        assert torch.equal(a, b)
    assert target_weights([5, 1, 3], "seq-mean-token-sum") == [0.5, 0.0, 0.5]
    assert target_weights([5, 1, 3], "seq-mean-token-sum-norm") == [0.2, 0.0, 0.2]
    masked = WeightedBatch(batch, weights=[torch.tensor([0, 1, 1, 0, 1.0]), torch.ones(1),
                                           torch.tensor([1, 0.5, 1])])
    assert masked.labels[0].tolist()[0] == -100 and masked.sums == [(2.0, 2), (0.0, 0),
                                                                     (1.5, 2)]
    assert LossWeights(plan, masked).per_token  # float weights need per-token losses
    with pytest.raises(ValueError, match="sequence 0 has 5 tokens and 4 weights"):
        WeightedBatch(batch, weights=[torch.ones(4), torch.ones(1), torch.ones(3)])
    with pytest.raises(ValueError, match="loss_reduction='mean'"):
        LossWeights(plan, batch, "mean")
