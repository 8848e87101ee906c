"""Activation memory by implementation: what autograd keeps per token of a layer, of the model's
ends and of the loss, one row per implementation the project runs (issue 55).

The planner's ``A`` (`megatron_dcp.plan.geometry.Geometry.act_bytes`) was one formula, "a fused
layer", for every model. Megatron-core's layer without Transformer Engine (the local spec) keeps
about twice that (torch's RMSNorm keeps fp32 copies, the unfused SwiGLU two more FFN-wide
tensors, RoPE's cos and sin per call), and the planner promised tokens that do not fit. Here each
row is a sum of named saved tensors, each with the library file that saves it, in bytes per local
token on one tensor-parallel rank (bf16 activations, fp32 statistics). A `ModelShape` names its
rows (``layer_memory``, ``loss_memory``; ``None``: the planner's own formula, as before); the
Megatron adapter picks them from the model it builds (`megatron_layer_row`).

A row is *measured* where this project builds that layer on a CPU and ``tests/test_layer_memory.py``
compares the row's bytes with the bytes ``torch.autograd.graph.saved_tensors_hooks`` sees (unique
storages, parameters left out) at several widths and token counts; *counted* where it is read
from the library's source and not run here (Transformer Engine: CUDA only).

Names: ``h`` hidden, ``q`` query width (heads x head dim), ``kv`` key/value width, ``d`` head
dim, ``H`` query heads, ``f`` FFN width. ``seq(x)``: split along the sequence by sequence
parallelism (``x / tp`` with SP, else whole); ``split(x)``: split over the TP ranks by heads or
FFN columns (``x / tp``). Attention's figures are those of a degree-1 task (flash attention's
saved tensors: q, k, v, the output and its log-sum-exp); under Ulysses the received q, k, v
replace the RoPE'd ones and the projection's storage (``2 (q + kv)`` less): the row is an upper
bound there.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

BF16, FP32 = 2, 4


class Dims(NamedTuple):
    """The widths a row reads (`dims_of` builds them from a `ModelShape`)."""

    h: int
    q: int
    kv: int
    d: int
    heads: int
    f: int
    gated: bool
    tp: int
    sp: bool
    norm: str = "RMSNorm"

    def seq(self, x: float) -> float:
        return x / self.tp if self.sp and self.tp > 1 else x

    def split(self, x: float) -> float:
        return x / self.tp


class Saved(NamedTuple):
    """One saved tensor (or a named group): bytes per local token, and who saves it."""

    name: str
    bytes: float
    source: str


class Row(NamedTuple):
    """An implementation: its layer's and the model ends' saved tensors, measured or counted."""

    title: str
    how: str
    layer: Callable[[Dims], list]
    ends: Callable[[Dims], list]


def _torch_norm(x: Dims) -> float:
    """torch's norm as it runs on the CPU and on meta: ``rms_norm`` decomposes and keeps the
    fp32 input and normalised product (``8h``) and ``rstd``; ``native_layer_norm`` keeps its
    input, mean and rstd. (CUDA's fused ``_fused_rms_norm`` keeps the bf16 input and rstd:
    ``6h`` less; the row keeps the larger figure, what the dry run measures.)"""
    return x.seq(FP32 * 2 * x.h + FP32) if x.norm == "RMSNorm" else x.seq(BF16 * x.h + 2 * FP32)


def _ffn_out(x: Dims) -> float:
    return x.split(BF16 * (2 if x.gated else 1) * x.f)


def _attention(x: Dims, saver: str) -> list:
    """q, k and v as attention saves them: q and k RoPE'd (new tensors), v a view of the q/k/v
    projection's output, whose whole storage therefore stays (``saver``: the attention)."""
    return [
        Saved("q/k/v projection output (v is a view: the whole storage stays)",
              x.split(BF16 * (x.q + 2 * x.kv)),
              "megatron/core/transformer/attention.py get_query_key_value_tensors"),
        Saved("q and k after RoPE (new tensors)", x.split(BF16 * (x.q + x.kv)), saver),
    ]


def _megatron_local(swiglu_fused: bool) -> Callable[[Dims], list]:
    def layer(x: Dims) -> list:
        linear = "megatron/core/tensor_parallel/layers.py LinearWithGradAccumulation..."
        rows = [
            Saved("input_layernorm (torch)", _torch_norm(x),
                  "torch/nn/modules/normalization.py RMSNorm (megatron_dcp SPNorm)"),
            Saved("linear_qkv input (the norm's bf16 output; before SP's all-gather)",
                  x.seq(BF16 * x.h), linear),
            *_attention(x, "megatron_dcp/runtime/kernels.py LocalAttention"),
            Saved("attention output (also linear_proj's saved input) and its log-sum-exp",
                  x.split(BF16 * x.q + FP32 * x.heads),
                  "megatron_dcp/runtime/kernels.py LocalAttention"),
            Saved("RoPE cos and sin, for q and for k (unfused)", 4 * BF16 * x.d,
                  "megatron/core/models/common/embeddings/rope_utils.py "
                  "_apply_rotary_pos_emb_bshd"),
            Saved("pre_mlp_layernorm (torch)", _torch_norm(x),
                  "torch/nn/modules/normalization.py RMSNorm"),
            Saved("linear_fc1 input", x.seq(BF16 * x.h), linear),
            Saved("linear_fc1 output", _ffn_out(x),
                  "megatron/core/fusions/fused_bias_swiglu.py SwiGLUFunction" if swiglu_fused
                  else "megatron/core/transformer/mlp.py glu (silu's input)"),
            Saved("linear_fc2 input (the activation's output)", x.split(BF16 * x.f), linear),
        ]
        if x.gated and not swiglu_fused:
            rows.append(Saved("unfused SwiGLU: silu(gate) and up + glu_linear_offset",
                              x.split(2 * BF16 * x.f), "megatron/core/transformer/mlp.py glu"))
        return rows
    return layer


def _megatron_local_ends(x: Dims) -> list:
    rows = [Saved("embedding output", x.seq(BF16 * x.h),
                  "megatron/core/models/common/embeddings/language_model_embedding.py"),
            Saved("final_layernorm (torch)", _torch_norm(x),
                  "torch/nn/modules/normalization.py RMSNorm"),
            Saved("output_layer input", x.seq(BF16 * x.h),
                  "megatron/core/tensor_parallel/layers.py ColumnParallelLinear")]
    if x.sp and x.tp > 1:
        rows.append(Saved("SP all-gather buffer (the gathered layer input, reused)",
                          BF16 * x.h, "megatron/core/utils.py GlobalMemoryBuffer"))
    return rows


def _te_layer(x: Dims) -> list:
    te = "transformer_engine/pytorch/module/"
    norm = x.seq(BF16 * x.h + FP32)  # the norm's input and rsigma (mu too for LayerNorm)
    return [
        Saved("LayerNormLinear (qkv): norm input, rsigma, ln_out", norm + x.seq(BF16 * x.h),
              te + "layernorm_linear.py _LayerNormLinear"),
        *_attention(x, "transformer_engine/pytorch/attention/rope.py FusedRoPEFunc (it "
                       "saves only the model's freqs) and the attention that saves q, k"),
        Saved("attention output (linear_proj's saved input: a view) and softmax statistics",
              x.split(BF16 * x.q + FP32 * x.heads),
              "transformer_engine/pytorch/attention/dot_product_attention/backends.py"),
        Saved("LayerNormMLP: norm input, rsigma, ln_out", norm + x.seq(BF16 * x.h),
              te + "layernorm_mlp.py _LayerNormMLP"),
        Saved("LayerNormMLP: fc1 output and activation output",
              _ffn_out(x) + x.split(BF16 * x.f), te + "layernorm_mlp.py _LayerNormMLP"),
    ]


def _te_ends(x: Dims) -> list:
    return [Saved("embedding output", x.seq(BF16 * x.h),
                  "megatron/core/models/common/embeddings/language_model_embedding.py"),
            Saved("final_layernorm: input and rsigma", x.seq(BF16 * x.h + FP32),
                  "transformer_engine/pytorch/module/rmsnorm.py"),
            Saved("output_layer input", x.seq(BF16 * x.h),
                  "megatron/core/tensor_parallel/layers.py ColumnParallelLinear")]


def _dcp_decoder(x: Dims) -> list:
    common, kernels = "megatron_dcp/models/common.py", "megatron_dcp/runtime/kernels.py"
    return [
        Saved("attn_norm: the layer's input and rstd (bf16)", BF16 * x.h + BF16,
              common + " _RMSNormFunction"),
        Saved("wq/wk/wv input (the norm's output)", BF16 * x.h, "torch/nn/modules/linear.py"),
        Saved("q and k after RoPE, v, the attention output (wo's saved input) and its "
              "log-sum-exp", BF16 * (2 * x.q + 2 * x.kv) + FP32 * x.heads,
              kernels + " LocalAttention"),
        Saved("mlp_norm: its input and rstd", BF16 * x.h + BF16, common + " _RMSNormFunction"),
        Saved("w_gate/w_up input (the norm's output)", BF16 * x.h, "torch/nn/modules/linear.py"),
        Saved("SwiGLU: gate and up", 2 * BF16 * (x.f if x.gated else 0), common + " _SwiGLU"),
        Saved("w_down input", BF16 * x.f, "torch/nn/modules/linear.py"),
    ]


def _dcp_decoder_ends(x: Dims) -> list:
    return [Saved("final norm: its input and rstd; the output projection's input",
                  2 * BF16 * x.h + BF16, "megatron_dcp/models/decoder.py Decoder")]


def _hf_norm(x: Dims) -> Saved:
    return Saved("RMSNorm: the fp32 input, rstd, the bf16 normalised product", FP32 * x.h + FP32
                 + BF16 * x.h, "transformers/models/llama/modeling_llama.py LlamaRMSNorm")


def _hf_eager(x: Dims) -> list:
    model = "transformers/models/llama/modeling_llama.py "
    return [
        _hf_norm(x),
        Saved("q/k/v_proj input (the norm's output)", BF16 * x.h, model + "LlamaAttention"),
        Saved("q and k after RoPE, v, the attention output (o_proj's saved input) and its "
              "log-sum-exp", BF16 * (2 * x.q + 2 * x.kv) + FP32 * x.heads,
              "megatron_dcp/integrations/hf.py hf_attention -> megatron_dcp/runtime/kernels.py"),
        _hf_norm(x),
        Saved("gate/up_proj input", BF16 * x.h, model + "LlamaMLP"),
        Saved("gate and up outputs, silu(gate), their product (down_proj's input)",
              4 * BF16 * x.f, model + "LlamaMLP, transformers/activations.py SiLU"),
    ]


def _hf_eager_ends(x: Dims) -> list:
    return [_hf_norm(x),
            Saved("lm_head input; RoPE's cos and sin; position ids", BF16 * x.h
                  + 2 * BF16 * x.d + 8, "transformers/models/llama/modeling_llama.py")]


LAYER_ROWS: dict[str, Row] = {
    "hf-eager": Row("Hugging Face Llama/Qwen2/Mistral decoder layer (DCP's attention)",
                    "measured", _hf_eager, _hf_eager_ends),
    "dcp-decoder": Row("DCP's reference decoder (megatron_dcp.models.decoder)", "measured",
                       _dcp_decoder, _dcp_decoder_ends),
    "megatron-local": Row("Megatron's local layer, no fusions", "measured",
                          _megatron_local(False), _megatron_local_ends),
    "megatron-local-swiglu": Row("Megatron's local layer, fused SwiGLU "
                                 "(--bias-swiglu-fusion)", "measured",
                                 _megatron_local(True), _megatron_local_ends),
    "transformer-engine": Row("Transformer Engine's fused layer", "counted", _te_layer,
                              _te_ends),
}
"""Layer rows by name (`ModelShape.layer_memory`). Megatron's other fusion flags change nothing
here: bias-dropout fusion saves nothing without a bias and with dropout 0 (which DCP needs;
measured equal), and RoPE and norm fusions need Transformer Engine or Apex (the TE row)."""


class LossRow(NamedTuple):
    """A loss implementation: bytes per vocabulary entry per local token at its peak."""

    title: str
    per_entry: float
    source: str


LOSS_ROWS: dict[str, LossRow] = {
    "megatron-vocab-parallel": LossRow(
        "Megatron's vocabulary-parallel cross-entropy (fused or not)", BF16 + FP32,
        "megatron/core/tensor_parallel/cross_entropy.py and fusions/fused_cross_entropy.py: "
        "the output layer's bf16 logits and their fp32 copy (exp'd and normalised in place, "
        "saved as the softmax) in forward; in backward the fp32 gradient and its bf16 cast"),
    "te-parallel-cross-entropy": LossRow(
        "Transformer Engine's parallel cross-entropy (--cross-entropy-fusion-impl te)", BF16,
        "transformer_engine/pytorch/cross_entropy.py: the gradient written into the bf16 "
        "logits in place (counted)"),
}
"""Loss rows by name (`ModelShape.loss_memory`); ``None``: DCP's chunked loss
(`megatron_dcp.plan.memory.loss_bytes`, measured in docs/BENCHMARKS.md). A tiled task's loss
keeps one tile's logits (`MemoryModel.long_memory_of`)."""


def dims_of(model) -> Dims:
    """`Dims` of a `ModelShape`."""
    return Dims(h=model.hidden_size, q=model.num_heads * model.head_dim,
                kv=model.kv_heads * model.head_dim, d=model.head_dim, heads=model.num_heads,
                f=model.ffn_hidden_size, gated=model.gated_mlp, tp=model.tensor_parallel,
                sp=model.sequence_parallel)


def layer_saved(model) -> list:
    """The named saved tensors of one layer of ``model``'s row (`ModelShape.layer_memory`)."""
    return LAYER_ROWS[model.layer_memory].layer(dims_of(model))


def layer_bytes(model) -> float:
    """Bytes per local token one layer of ``model``'s row keeps for backward."""
    return sum(s.bytes for s in layer_saved(model))


def ends_bytes(model) -> float:
    """Bytes per local token of the model's ends (embedding output, final norm, the output
    layer's input) in ``model``'s row; 0 without a row (the planner's formula left them out)."""
    if model.layer_memory is None:
        return 0.0
    return sum(s.bytes for s in LAYER_ROWS[model.layer_memory].ends(dims_of(model)))


def loss_entry_bytes(model) -> Optional[float]:
    """Bytes per vocabulary entry per local token of ``model``'s loss row (``None``: none)."""
    return None if model.loss_memory is None else LOSS_ROWS[model.loss_memory].per_entry


def describe(model) -> str:
    """The rows the planner uses, for the start-up line: name, measured or counted, KB a token
    a layer."""
    if model.layer_memory is None:
        return "layer memory: the planner's formula (no implementation row)"
    row = LAYER_ROWS[model.layer_memory]
    text = (f"layer memory: {model.layer_memory} ({row.how}, "
            f"{layer_bytes(model) / 1024:.0f} KB a token a layer)")
    if model.loss_memory is not None:
        text += f", loss {model.loss_memory}"
    return text


def check_rows(layer: Optional[str], loss: Optional[str]) -> None:
    """`ValueError` naming the known rows when ``layer`` or ``loss`` is not one."""
    for key, value, known in (("layer_memory", layer, LAYER_ROWS),
                              ("loss_memory", loss, LOSS_ROWS)):
        if value is not None and value not in known:
            raise ValueError(f"model.{key}={value!r}: not a known row; known: "
                             f"{', '.join(sorted(known))}")


def megatron_layer_row(transformer_impl: str, swiglu_fusion: bool) -> str:
    """The layer row of the model Megatron builds: Transformer Engine's spec, or the local spec
    with or without the fused SwiGLU (Megatron-LM's ``--transformer-impl``,
    ``--no-bias-swiglu-fusion``)."""
    if transformer_impl == "transformer_engine":
        return "transformer-engine"
    return "megatron-local-swiglu" if swiglu_fusion else "megatron-local"
