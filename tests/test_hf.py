"""Hugging Face causal LMs under DCP (`megatron_dcp.integrations.hf`).

Tiny Llama (tied embeddings), Qwen2 (q/k/v biases) and Mistral (sliding-window keyword) models,
built from config dicts (no downloads), run hand-made plans at world 2 and 4 (Ulysses, ring,
hybrid, packed tasks, per-task recomputed layers) through the step driver, with every backward on
a fresh thread (as CUDA's autograd engine), so the task reaches attention and recompute only
through the model call itself. Loss and gradients must equal
single-process training of the same weights with HF's eager attention (fp32, 1e-5), and each
decoder layer must run as often as the plan's recompute_layers say.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distributed import run_distributed  # noqa: E402
from executor_cases import make_batch, on_fresh_thread, plan_dict, rel_err  # noqa: E402
from executor_cases import task as make_task  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

TOL = 1e-5
COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              attention_dropout=0.0)
CONFIGS = {
    "llama": ("LlamaConfig", dict(COMMON, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(COMMON)),  # q/k/v biases
    "mistral": ("MistralConfig", dict(COMMON, sliding_window=32)),  # window >= every length
}
LENGTHS = (29, 7, 13, 18, 3, 22)
# world 2: Ulysses 2 with recompute, ring 2 on reversed ranks packing two sequences, packed
# degree-1 task, different micro-step counts
PLAN_2 = plan_dict([make_task(0, (0, 1), (0,), ulysses=2, recompute_layers=2, start=0.0),
                    make_task(1, (1, 0), (3, 4), ulysses=1, recompute_layers=1, start=1.0),
                    make_task(2, (0,), (1, 2), recompute_layers=0, start=2.0),
                    make_task(3, (1,), (5,), recompute_layers=1, start=2.0)], LENGTHS, 2)
# world 4: hybrid 2 x 2 packing two sequences, ring 3 (heads not divisible), rank 3 then idle
PLAN_4 = plan_dict([make_task(0, (0, 1, 2, 3), (0, 5), ulysses=2, recompute_layers=1, start=0.0),
                    make_task(1, (2, 1, 0), (3,), ulysses=1, recompute_layers=2, start=1.0),
                    make_task(2, (0,), (1, 2), recompute_layers=0, start=2.0),
                    make_task(3, (1,), (4,), recompute_layers=2, start=2.0)], LENGTHS, 4)


def build(kind: str, attn: str = "eager") -> torch.nn.Module:
    """The tiny HF model of ``kind``, the same weights on every call."""
    name, values = CONFIGS[kind]
    config = getattr(transformers, name)(**values)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def reference(kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients: every sequence alone, summed token losses / T."""
    model = build(kind)
    model.train()
    batch = make_batch(LENGTHS, COMMON["vocab_size"])
    total = sum(n - 1 for n in LENGTHS)
    loss = torch.zeros(())
    for ids in batch:
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        loss = loss + torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")
    loss = loss / total
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _body(rank, world_size, plan):
    from plain_torch import TorchEngine

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.integrations.hf import DCPCausalLM
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    pool = GroupPool()
    plan = Plan.from_dict(plan)
    out = {}
    for kind in CONFIGS:
        model = DCPCausalLM(build(kind))
        calls = [0] * COMMON["num_hidden_layers"]
        for i, layer in enumerate(model.causal_lm.model.layers):
            layer.mlp.register_forward_pre_hook(
                lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.0),
                             pool.world_group)
        engine.backward = lambda loss, last: on_fresh_thread(loss.backward)
        driver = StepDriver(DCPConfig(enabled=True), pool=pool, model_shape=model.shape())
        result = driver.step(engine, make_batch(LENGTHS, COMMON["vocab_size"]), plan)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()} if rank == 0 else None
        out[kind] = (result.loss, grads, calls)
    return out


def _expected_calls(plan: dict, rank: int) -> list[int]:
    calls = [0] * COMMON["num_hidden_layers"]
    for t in plan["tasks"]:
        if rank in t["ranks"]:
            for i in range(len(calls)):
                calls[i] += 1 + (i < t["recompute_layers"])
    return calls


@pytest.fixture(scope="module")
def references():
    return {kind: reference(kind) for kind in CONFIGS}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, plan", [(2, PLAN_2), (4, PLAN_4)], ids=["w2", "w4"])
def test_models_match_single_process_training(references, world_size, plan):
    results = run_distributed(_body, world_size=world_size, args=(plan,), timeout_s=280)
    for kind, (ref_loss, ref_grads) in references.items():
        for rank, res in enumerate(results):
            loss, grads, calls = res[kind]
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (kind, rank, loss, ref_loss)
            assert calls == _expected_calls(plan, rank), (kind, rank, calls)
        grads = results[0][kind][1]
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert rel_err(grads[name], g) <= TOL, (kind, name, rel_err(grads[name], g))


# ---------------------------------------------------------------------- one process
def _task(lengths, recompute_layers=0):
    """A one-rank task context over sequences of ``lengths`` (no process group needed)."""
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime.context import TaskContext
    from megatron_dcp.runtime.layout import ShardLayout

    task = Task(id=0, ranks=(0,), seqs=tuple(range(len(lengths))),
                recompute_layers=recompute_layers)
    return TaskContext(task=task, group_rank=0, layout=ShardLayout.build(lengths, 1, 1, 0),
                       recompute_layers=recompute_layers)


def test_dcp_attention_outside_a_task_equals_eager_with_padding_and_generate():
    from megatron_dcp.integrations.hf import enable

    eager, model = build("qwen2"), build("qwen2")
    enable(model)
    assert model.config._attn_implementation == "dcp"
    ids = torch.randint(0, COMMON["vocab_size"], (2, 12),
                        generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding: the user's mask must be honoured outside a task
    for m in (eager, model):
        m.eval()
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = eager(input_ids=ids, attention_mask=mask).logits
        assert rel_err(a[0], b[0]) <= TOL and rel_err(a[1, 4:], b[1, 4:]) <= TOL
        gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:1], use_cache=True, **gen),
                           eager.generate(ids[:1], use_cache=True, **gen))


def test_packed_task_in_one_process_matches_sequences_alone():
    """A degree-1 task packing two sequences: no attention across them (where HF's SDPA path
    would need the packed-position mask), recompute of layer 0 on a fresh thread."""
    from megatron_dcp.integrations.hf import DCPCausalLM

    model, eager = DCPCausalLM(build("llama")), build("llama")
    a, b = make_batch((9, 14), COMMON["vocab_size"])
    ids, pos = torch.cat([a, b]), torch.cat([torch.arange(9), torch.arange(14)])
    logits = model(ids, pos, task=_task((9, 14), recompute_layers=1))
    on_fresh_thread(logits.float().square().sum().backward)
    with torch.no_grad():
        want = torch.cat([eager(input_ids=x[None]).logits[0] for x in (a, b)])
    assert rel_err(logits.detach(), want) <= TOL
    assert all(p.grad is not None for p in model.parameters())


def test_state_dict_keys_are_the_hf_models():
    from megatron_dcp.integrations.hf import DCPCausalLM

    hf = build("llama")
    keys = list(hf.state_dict())
    model = DCPCausalLM(hf)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in hf.named_parameters()]
    model.eval()
    assert not hf.training and not hf.model.layers[0].training


def test_refusals():
    from megatron_dcp.integrations.hf import DCPCausalLM, enable

    name, values = CONFIGS["llama"]
    dropout = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, name)(**dict(values, attention_dropout=0.1)))
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        enable(dropout)
    with pytest.raises(ValueError, match="sliding window 32 is shorter"):
        enable(build("mistral"), max_sequence_length=40)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        enable(torch.nn.Linear(2, 2))
    # a task whose sequence is longer than the window: refused inside attention
    model = DCPCausalLM(build("mistral"))
    ids = torch.zeros(40, dtype=torch.long)
    with pytest.raises(ValueError, match="longer than the sliding window 32"):
        model(ids, torch.arange(40), task=_task((40,)))
    # a softmax DCP's kernels do not compute (Gemma's soft-capping)
    from megatron_dcp.integrations.hf import hf_attention

    q = torch.zeros(1, 4, 6, 16)
    with pytest.raises(ValueError, match="softcap is not supported"):
        hf_attention(torch.nn.Module(), q, q[:, :2], q[:, :2], None, softcap=30.0,
                     dcp_task=_task((6,)))
    # HF's own checkpointing switch replaces the per-task recompute hook: detected
    model = DCPCausalLM(build("llama"))
    model.causal_lm.activation_checkpointing_enable()
    with pytest.raises(RuntimeError, match="lost DCP's per-task recompute hook"):
        model(ids[:8])


def test_model_shape_counts_parameters():
    """The planner's parameter count equals the model's (norm weights aside) for tied
    embeddings, q/k/v biases and heads wider than hidden / heads."""
    from megatron_dcp.integrations.hf import model_shape
    from megatron_dcp.plan import build_cost_model
    from megatron_dcp.config import DCPConfig

    name, values = CONFIGS["qwen2"]
    wide = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, name)(**dict(values, head_dim=32, tie_word_embeddings=True)))
    for model in (build("llama"), build("qwen2"), wide):
        shape = model_shape(model)
        counted = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
        cost = build_cost_model(shape, DCPConfig(enabled=True), 2)
        assert cost.params == counted, (shape, cost.params, counted)
    assert model_shape(wide).head_dim == 32 and model_shape(wide).tied_embeddings
    assert model_shape(build("qwen2")).qkv_bias and not model_shape(build("llama")).qkv_bias
