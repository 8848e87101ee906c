"""Hugging Face ``labels`` with -100 inside sequences under the DeepSpeed plugin (issue 57).

HF's labels are unshifted (the model shifts them: ``labels[i + 1]`` is the target of token
``i``); `from_hf_labels` turns them into DCP's per-token targets and ``engine.train_step(batch,
hf_labels=...)`` trains them, the whole batch on every rank or each rank's share
(``local=True``: the targets travel with the tokens; so do a `WeightedBatch` share's). A tiny HF
Llama at every ZeRO stage (0 and 1: free plans; 2 and 3: lockstep plans, ZeRO-3 with every
parameter partitioned), 2 gloo ranks, SGD: every step's loss equals a one-process reference that
calls HF's own loss (``model(input_ids, labels=, num_items_in_batch=)``), and the parameters
equal plain DeepSpeed's, with plans that split sequences over both ranks."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from distributed import run_distributed, smallest_budget_gb
from executor_cases import make_batch

transformers = pytest.importorskip("transformers")

LENGTHS = (40, 9, 23, 31, 14, 5, 27, 18)
VOCAB = 64
STEPS = 2
LR = 0.5
REL_TOL = 1e-5
MODEL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             attention_dropout=0.0)


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL)
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _data(step: int):
    """A global batch and its HF labels: a masked prompt, holes inside the answer, one
    sequence that trains nothing; another order each step."""
    lengths = LENGTHS[step:] + LENGTHS[:step]
    ids = make_batch(lengths, VOCAB, seed=5 + step)
    gen = torch.Generator().manual_seed(17 + step)
    labels = []
    for seq in ids:
        label = seq.clone()
        label[:len(seq) // 3] = -100  # a prompt
        label[(torch.rand(len(seq), generator=gen) < 0.25)] = -100  # holes
        if len(seq) == 5:
            label[:] = -100
        labels.append(label)
    return ids, labels


def _reference() -> list[float]:
    """One process, HF's own loss over the whole global batch (the sum of every sequence's
    cross-entropy over its trained targets / their number in the batch), SGD."""
    model = _llama()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids, labels = _data(step)
        items = sum(int((lab[1:] != -100).sum()) for lab in labels)
        loss = sum(model(input_ids=x[None], labels=y[None], num_items_in_batch=items).loss
                   for x, y in zip(ids, labels))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _budget(stage: int) -> float:
    """The smallest budget in which the longest sequence fits at all: it needs both ranks."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.integrations import hf
    from megatron_dcp.plan import make_plan

    shape = hf.model_shape(_llama())
    return float(smallest_budget_gb(
        lambda gib: make_plan([max(LENGTHS)], world_size=2, model=shape, zero_stage=stage,
                              config=DCPConfig(enabled=True, hardware="h200",
                                               memory_budget_gb=gib)), 0.0, 64.0))


def _train(rank: int, world: int, stage: int, mode: str) -> dict:
    import deepspeed

    import deepspeed_plugin
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.integrations.hf_labels import from_hf_labels
    from megatron_dcp.runtime.input_stage import share_of

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    model = _llama()
    zero = {"stage": stage}
    if stage == 3:  # every parameter partitioned
        zero.update(stage3_param_persistence_threshold=0, stage3_model_persistence_threshold=0)
    config = {"gradient_clipping": 0.0, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True}
    dcp = DCPConfig(enabled=mode != "dp", hardware="h200", liveness_interval_s=0,
                    calibration="off", memory_budget_gb=_budget(stage) if mode != "dp" else None)
    engine, *_ = deepspeed_plugin.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config,
        dcp_config=dcp, timeout=timedelta(seconds=60))
    try:
        out = {"losses": [], "degrees": [], "tokens": []}
        for step in range(STEPS):
            ids, labels = _data(step)
            if mode == "local":  # step 0: hf_labels; step 1: the share as a WeightedBatch
                share = share_of(len(ids), rank, world)
                mine, theirs = [ids[i] for i in share], [labels[i] for i in share]
                result = engine.train_step(mine, local=True, hf_labels=theirs) if step == 0 \
                    else engine.train_step(from_hf_labels(mine, theirs), local=True)
            else:
                result = engine.train_step(ids, hf_labels=labels)
            out["losses"].append(result.loss)
            out["tokens"].append(result.tokens)
            out["degrees"].append(max((t.degree for t in result.plan.tasks), default=1))
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                               enabled=stage == 3):
            out["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        return out
    finally:
        engine.driver.close()
        engine.deepspeed.destroy()


def _refused(rank: int, world: int) -> str:
    """Rank 1's share has a label short: every rank raises the same error (none waits)."""
    import deepspeed_plugin
    from megatron_dcp.config import DCPConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    model = _llama()
    engine, *_ = deepspeed_plugin.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        config={"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                "gradient_clipping": 0.0},
        dcp_config=DCPConfig(enabled=True, hardware="h200", liveness_interval_s=0),
        timeout=timedelta(seconds=60))
    try:
        ids, labels = _data(0)
        if rank == 1:
            labels[0] = labels[0][:-1]
        try:
            engine.train_step(ids[:2], local=True, hf_labels=labels[:2])
        except ValueError as err:
            return str(err)
        return "ran"
    finally:
        engine.driver.close()
        engine.deepspeed.destroy()


def _modes(rank: int, world: int, stage: int) -> dict:
    out = {mode: _train(rank, world, stage, mode) for mode in ("dcp", "local", "dp")}
    if stage == 2:
        out["refused"] = _refused(rank, world)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=["zero0", "zero1", "zero2", "zero3"])
def test_hf_labels_with_holes_train_as_hf_computes_them(stage):
    results = run_distributed(_modes, 2, args=(stage,), timeout_s=380.0, group_timeout_s=60.0,
                              grace_s=70.0)
    ref = _reference()
    trained = [sum(int((lab[1:] != -100).sum()) for lab in _data(s)[1]) for s in range(STEPS)]
    if stage == 2:
        assert {got.pop("refused") for got in results} == {
            "train_step(local=True): rank 1's hf_labels: sequence 0 has 40 tokens and 39 labels "
            "(HF's labels are unshifted: one per token)"}
    for rank, got in enumerate(results):
        for mode, run in got.items():
            for i, (a, b) in enumerate(zip(run["losses"], ref, strict=True)):
                assert abs(a - b) <= REL_TOL * abs(b), (stage, mode, rank, i, a, b)
            assert run["tokens"] == trained, (mode, run["tokens"], trained)
            for name, p in got["dp"]["params"].items():
                err = float((run["params"][name] - p).norm() / p.norm().clamp_min(1e-30))
                assert err <= REL_TOL, f"ZeRO-{stage} {mode} rank {rank}: {name} {err:.2e}"
        assert max(got["dcp"]["degrees"]) > 1 and max(got["local"]["degrees"]) > 1


# ---------------------------------------------------------------------- one process
def test_hf_labels_are_shifted_once_and_padding_dropped():
    from megatron_dcp.integrations.hf_labels import from_hf_labels

    ids = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])]
    hf = [torch.tensor([-100, 6, -100, 8]), torch.tensor([-100, 10])]
    batch = from_hf_labels(ids, hf)
    assert batch.labels[0].tolist() == [6, -100, 8, -100]
    assert batch.weights[0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch.labels[1].tolist() == [10, -100] and batch.sums == [(2.0, 2), (1.0, 1)]
    # HF's padded batch: left and right padding dropped by the attention mask
    padded = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 0, 0, 0, 0]])
    labels = torch.tensor([[-100, -100, -100, 6, -100, 8], [-100, 10, -100, -100, -100, -100]])
    mask = (torch.arange(6) >= 2).long()[None].repeat(2, 1)
    mask[1] = (torch.arange(6) < 2).long()
    again = from_hf_labels(padded, labels, mask)
    assert [s.tolist() for s in again] == [s.tolist() for s in ids]
    assert [x.tolist() for x in again.labels] == [x.tolist() for x in batch.labels]


def test_hf_labels_loss_is_hfs_own():
    """DCPCausalLM's token losses with the converted labels: HF's loss of the same labels."""
    from megatron_dcp.integrations.hf import DCPCausalLM
    from megatron_dcp.integrations.hf_labels import from_hf_labels

    ids, labels = _data(0)
    model, hf = DCPCausalLM(_llama()), _llama()
    batch = from_hf_labels(ids[:1], labels[:1])
    with torch.no_grad():
        got = model(batch[0], labels=batch.labels[0]).sum() / batch.sums[0][0]
        want = hf(input_ids=ids[0][None], labels=labels[0][None]).loss
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want))


@pytest.mark.parametrize("args, message", [
    (([torch.arange(4)], [torch.arange(3)]), "sequence 0 has 4 tokens and 3 labels"),
    (([torch.arange(4)], [torch.tensor([1, -5, 2, 3])]), "sequence 0 has label -5 at position 1"),
    ((torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)),
     r"labels of shape \(2, 3\) for input_ids of shape \(2, 4\)"),
    ((torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long),
      torch.tensor([[1, 0, 1, 1]])), "row 0's attention_mask is not one run of 1s"),
    (([torch.arange(4)], [torch.arange(4), torch.arange(4)]), "2 labels for 1 sequences"),
], ids=["length", "negative", "shape", "mask", "count"])
def test_hf_labels_refusals(args, message):
    from megatron_dcp.integrations.hf_labels import from_hf_labels

    with pytest.raises(ValueError, match=message):
        from_hf_labels(*args)
