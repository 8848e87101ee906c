"""Layer memory by implementation (issue 55, `megatron_dcp.plan.layer_memory`).

Each *measured* row is compared with a real layer: one megatron-core layer of DCP's spec (the
local spec, bf16, on the CPU) runs its forward as a degree-1 DCP task under
``torch.autograd.graph.saved_tensors_hooks``; the bytes of the unique storages autograd saves
(parameters left out) must equal the row's bytes per token times the tokens, at two widths (one
whose query width differs from the hidden size) and two token counts, with and without the
fused SwiGLU. Attention runs DCP's kernel with its output in the input dtype, as flash
attention returns it on a GPU and on the dry run's meta device (the CPU kernel computes in fp32).
The dry run at Llama-3-8B shape then checks the planner's whole figure (layers, the model's
ends, the loss at a 128,256-token vocabulary) against what it measures; the Megatron adapter
picks the row from Megatron-LM's flags, and the start-up line names it.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from distributed import run_distributed
from megatron_dcp.plan import load_model
from megatron_dcp.plan.layer_memory import layer_bytes, layer_saved
from megatron_dcp.plan.model import ModelShape

WIDTHS = ((256, 8, 2, 512, None), (256, 4, 2, 384, 32))
"""(hidden, heads, KV heads, FFN, head dim): the second's query width (128) is not the hidden."""
TOKENS = (16, 40)


def _shape(width, swiglu_fused: bool) -> ModelShape:
    h, heads, kv, f, d = width
    return ModelShape(num_layers=1, hidden_size=h, num_heads=heads, num_kv_heads=kv,
                      ffn_hidden_size=f, vocab_size=64, head_dim=d,
                      layer_memory="megatron-local-swiglu" if swiglu_fused else "megatron-local")


def _layer(width, swiglu_fused: bool):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dcp.megatron.spec import get_gpt_layer_dcp_spec

    h, heads, kv, f, d = width
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=heads, num_query_groups=kv,
        kv_channels=d, ffn_hidden_size=f, use_cpu_initialization=True,
        params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm", gated_linear_unit=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=swiglu_fused,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, calculate_per_token_loss=True)
    spec = get_gpt_layer_dcp_spec(normalization="RMSNorm", use_transformer_engine=False)
    return config, build_module(spec, config=config, layer_number=1)


def _saved_bytes(config, layer, tokens: int) -> int:
    """Bytes of the unique storages autograd saves in one forward of ``layer`` over a degree-1
    DCP task of ``tokens`` tokens (parameters left out)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_dcp.megatron.spec import DCPTaskParams
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime.context import TaskContext
    from megatron_dcp.runtime.layout import ShardLayout

    task = Task(id=0, ranks=(0,), seqs=(0,))
    layout = ShardLayout.build([tokens], 1, 1, 0)
    params = DCPTaskParams.of(TaskContext(task=task, group_rank=0, layout=layout))
    rope = RotaryEmbedding(config.kv_channels, rotary_percent=1.0)(params.max_seqlen_q)
    x = torch.randn(tokens, 1, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    return _saved(lambda: layer(x, attention_mask=None, rotary_pos_emb=rope,
                                packed_seq_params=params), layer.parameters())


def _measure(rank, world_size):
    from megatron.core import parallel_state

    from megatron_dcp.megatron.cpu.core import enable_cpu, seed_rng
    from megatron_dcp.runtime import kernels

    warnings.filterwarnings("ignore")
    enable_cpu()
    parallel_state.initialize_model_parallel()
    seed_rng(3)
    plain = kernels.run_forward
    kernels.run_forward = _flash_dtype(kernels)
    results = {}
    for i, width in enumerate(WIDTHS):
        for fused in (False, True):
            config, layer = _layer(width, fused)
            for tokens in TOKENS:
                results[(i, fused, tokens)] = _saved_bytes(config, layer, tokens)
    kernels.run_forward = plain
    return results


@pytest.mark.slow  # launches a process
@pytest.mark.timeout(240)
def test_megatron_local_rows_equal_the_bytes_a_real_layer_saves():
    pytest.importorskip("megatron.core")
    measured = run_distributed(_measure, world_size=1, timeout_s=220)[0]
    for (i, fused, tokens), got in measured.items():
        shape = _shape(WIDTHS[i], fused)
        want = layer_bytes(shape) * tokens
        assert got == want, (shape.layer_memory, WIDTHS[i], tokens, got, want,
                             [(s.name, s.bytes) for s in layer_saved(shape)])
    # the fused SwiGLU saves two FFN-wide tensors less a token (silu's output, up + offset)
    assert measured[(0, False, 16)] - measured[(0, True, 16)] == 16 * 2 * 2 * WIDTHS[0][3]


def _flash_dtype(kernels):
    plain = kernels.run_forward

    def run_forward(block, q, *args, **kwargs):  # flash's output dtype (module doc)
        out, lse = plain(block, q, *args, **kwargs)
        return out.to(q.dtype), lse.float()
    return run_forward


def test_the_dcp_decoder_row_equals_the_bytes_its_layer_saves(monkeypatch):
    """DCP's reference decoder layer (bf16, outside a task: local attention), two widths, two
    token counts; RoPE's tables are the model's (one per forward), left out like parameters."""
    from megatron_dcp.models.common import rope_tables
    from megatron_dcp.models.decoder import DecoderConfig, DecoderLayer
    from megatron_dcp.runtime import kernels

    monkeypatch.setattr(kernels, "run_forward", _flash_dtype(kernels))
    torch.manual_seed(0)
    for h, heads, kv, f, _ in WIDTHS:
        config = DecoderConfig(hidden_size=h, num_heads=heads, num_kv_heads=kv,
                               ffn_hidden_size=f)
        layer = DecoderLayer(config).to(torch.bfloat16)
        shape = ModelShape(num_layers=1, hidden_size=h, num_heads=heads, num_kv_heads=kv,
                           ffn_hidden_size=f, vocab_size=64, layer_memory="dcp-decoder")
        for tokens in TOKENS:
            cos, sin = rope_tables(torch.arange(tokens), config.head_dim, config.rope_theta,
                                   torch.bfloat16)
            model = [*layer.parameters(), cos, sin]
            x = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)
            got = _saved(lambda: layer(x, cos, sin, None), model)
            assert got == layer_bytes(shape) * tokens, (h, heads, tokens, got)


def _hf_saved(kind: str, layers: int, width, tokens: int) -> tuple[int, ModelShape]:
    """Saved bytes of a forward of a tiny HF ``kind`` model (bf16, eager, DCP's attention) of
    ``layers`` layers over a degree-1 task of ``tokens`` tokens, and its planner shape."""
    import transformers

    from megatron_dcp.integrations.hf import DCPCausalLM, model_shape
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime.context import TaskContext
    from megatron_dcp.runtime.layout import ShardLayout

    h, heads, kv, f, d = width
    name = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}[kind]
    config = getattr(transformers, name)(
        vocab_size=64, hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=d or h // heads,
        max_position_embeddings=256, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model = DCPCausalLM(hf)
    ctx = TaskContext(task=Task(id=0, ranks=(0,), seqs=(0,)), group_rank=0,
                      layout=ShardLayout.build([tokens], 1, 1, 0))
    ids = torch.randint(0, 64, (tokens,))
    got = _saved(lambda: model(ids, torch.arange(tokens), ctx),
                 [*model.parameters(), *model.buffers()])
    return got, model_shape(hf)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_the_hf_eager_row_equals_the_bytes_hf_layers_save(kind, monkeypatch):
    """A layer (two layers' bytes less one's) and the model's ends (the rest; HF's head saves
    its input, not the logits), two widths, two token counts, through `DCPCausalLM` and the
    planner's `model_shape`."""
    pytest.importorskip("transformers")
    from megatron_dcp.plan.layer_memory import ends_bytes
    from megatron_dcp.runtime import kernels

    monkeypatch.setattr(kernels, "run_forward", _flash_dtype(kernels))
    for width in WIDTHS:
        for tokens in TOKENS:
            one, shape = _hf_saved(kind, 1, width, tokens)
            two, _ = _hf_saved(kind, 2, width, tokens)
            assert shape.layer_memory == "hf-eager"
            assert two - one == layer_bytes(shape) * tokens, (width, tokens, two - one)
            assert 2 * one - two == ends_bytes(shape) * tokens, (width, tokens, 2 * one - two)


def _saved(forward, model) -> int:
    """Bytes of the unique storages autograd saves in ``forward()``, ``model``'s left out."""
    weights = {p.untyped_storage().data_ptr() for p in model}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()  # the graph is whole: what was saved is what backward uses
    return sum(seen.values())


def test_rows_split_by_tensor_and_sequence_parallelism():
    """Without SP the norms and the column-parallel layers' saved inputs stay whole on every TP
    rank, the head- and FFN-split tensors divide by TP; with SP all but RoPE's tables divide."""
    m = replace(load_model("llama3-8b"), layer_memory="megatron-local")
    one = layer_bytes(m)
    tp2 = layer_bytes(replace(m, tensor_parallel=2))
    sp = layer_bytes(replace(m, tensor_parallel=2, sequence_parallel=True))
    rope = 4 * 2 * m.head_dim
    assert sp == pytest.approx((one - rope) / 2 + rope)
    whole = 2 * (8 * m.hidden_size + 4) + 2 * 2 * m.hidden_size  # norms, qkv/fc1 inputs
    assert tp2 == pytest.approx(sp + whole / 2)
    te = layer_bytes(replace(m, layer_memory="transformer-engine"))
    assert te < one  # TE's fused norms and SwiGLU keep less than the local layer


def test_an_unknown_row_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="layer_memory='megatron'.*known: .*megatron-local"):
        ModelShape(num_layers=1, hidden_size=8, num_heads=2, ffn_hidden_size=8, vocab_size=8,
                   layer_memory="megatron")
    with pytest.raises(ValueError, match="loss_memory='x'.*megatron-vocab-parallel"):
        ModelShape(num_layers=1, hidden_size=8, num_heads=2, ffn_hidden_size=8, vocab_size=8,
                   loss_memory="x")


def _lm_args(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                num_query_groups=None, group_query_attention=False,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, sequence_parallel=False,
                num_experts=None)
    return SimpleNamespace(**{**base, **kw})


def test_the_megatron_adapter_picks_the_row_from_the_flags(monkeypatch):
    from megatron_dcp.megatron import moe_shape

    def shape(**kw):
        return moe_shape.megatron_model_shape(_lm_args(**kw), vocab_size=128,
                                              max_position=64, name="t")

    monkeypatch.setattr(moe_shape.importlib.util, "find_spec", lambda name: None)  # no TE
    assert shape(transformer_impl="local").layer_memory == "megatron-local"
    assert shape(transformer_impl="local", bias_swiglu_fusion=True).layer_memory \
        == "megatron-local-swiglu"
    # --transformer-impl transformer_engine without TE installed builds the local spec
    assert shape(transformer_impl="transformer_engine").layer_memory == "megatron-local"
    monkeypatch.setattr(moe_shape.importlib.util, "find_spec", lambda name: object())
    te = shape(transformer_impl="transformer_engine", cross_entropy_loss_fusion=True,
               cross_entropy_fusion_impl="te")
    assert (te.layer_memory, te.loss_memory) == ("transformer-engine",
                                                 "te-parallel-cross-entropy")
    assert shape(transformer_impl="transformer_engine").loss_memory == "megatron-vocab-parallel"


def test_the_start_up_line_names_the_row_and_how_it_is_known():
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan.planner import build_cost_model
    from megatron_dcp.runtime.report import setup_line

    config = DCPConfig()
    for row, how in (("megatron-local", "measured"), ("transformer-engine", "counted")):
        m = replace(load_model("llama3-8b"), layer_memory=row,
                    loss_memory="megatron-vocab-parallel")
        line = setup_line(config, build_cost_model(m, config, 8, "h100"), 8)
        assert f"layer memory: {row} ({how}, " in line, line
    plain = setup_line(config, build_cost_model(load_model("llama3-8b"), config, 8, "h100"), 8)
    assert "the planner's formula" in plain


@pytest.mark.slow  # in-process, about 10 s
def test_the_dry_run_measures_what_the_megatron_row_predicts(tmp_path):
    """Llama-3-8B shape, one 16,384-token sequence on 2 ranks (8,192 local tokens), Megatron's
    local layer on meta: the measured activations and temporaries (layers, the model's ends,
    the loss's logits and fp32 copy at 128,256 entries) within 3 % of the planner's, at 1 and 4
    layers. With the planner's formula it was 1.17x and 1.53x; with DDP's fp32 gradient buffer
    counted as activations (from its first in-place add in backward) 1.08x at 4 layers."""
    pytest.importorskip("megatron.core")
    from megatron_dcp.dryrun.__main__ import parse_args, run

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("16384\n")
    for layers in ("1", "4"):
        report = run(parse_args(["--engine", "megatron", "--gpus", "2", "--model", "llama3-8b",
                                 "--layers", layers, "--lengths", str(lengths),
                                 "--global-batch-tokens", "16384", "--max-len", "16384",
                                 "--ranks", "0"]))
        rank = report["ranks"][0]
        assert rank["error"] == "", rank["error"]
        ratio = rank["peak_bytes"] / rank["predicted_bytes"]
        assert 0.97 < ratio < 1.03, (layers, ratio)
