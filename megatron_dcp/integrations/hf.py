"""Hugging Face Transformers causal LMs (Llama, Qwen2, Mistral; Mixtral, Qwen2-MoE, Qwen3-MoE)
under DCP.

`enable(model)` prepares a ``PreTrainedModel`` in place: the ``"dcp"`` attention function
(`dcp_attention` inside a task, HF's SDPA with the user's mask outside one, so evaluation and
``generate`` still work), a per-task recompute hook on every decoder layer, ``use_cache=False``,
and the refusals (attention dropout, sliding windows shorter than a sequence). `DCPCausalLM`
wraps the model with the runtime's forward signature ``(input_ids [T], position_ids [T],
task) -> logits [T, V]`` and the HF model's own parameter names, so DeepSpeed's state dict keeps
HF's keys. Losses are computed from the logits with the project's shifted labels: HF's built-in
loss shifts the labels again inside the row, which is wrong on a shard.

Mixture-of-experts models train as any other (ZeRO shards their experts; no expert
parallelism). When their config asks for the router's load-balancing loss
(``output_router_logits`` and ``router_aux_loss_coef`` > 0), `DCPCausalLM` computes it per whole
sequence of the task (`megatron_dcp.runtime.moe.sequence_balancing_loss`: HF's per-batch value
would depend on the plan) and adds it to backward of the logits.

The task travels as the ``dcp_task`` keyword through HF's forward to every attention call (HF
passes unknown keywords down as ``**kwargs``) and, as part of the layer's bound forward, into
recomputation on whatever thread runs backward; nothing is looked up from the calling thread.

Inside a task the wrapper passes HF an empty 4-D mask (``[1, 1, 0, 0]`` booleans made on the
device, nothing read back): HF takes a 4-D mask as already built, so it neither builds a
``[T, T]`` mask from a shard's positions nor searches them for packed sequences
(``find_packed_sequence_indices`` reads a device value and so waits for the device on every
forward); the ``"dcp"`` attention takes the empty mask as "the task's layout decides".
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from megatron_dcp.models.common import check_inputs
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.runtime.attention import dcp_attention
from megatron_dcp.runtime.recompute import run_layer
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.offload import stash_for
from megatron_dcp.runtime.tiling import (TileableForward, loss_tiles_of, mlp_tiles_of,
                                         tiled_logits_loss, tiled_mlp)

ATTENTION = "dcp"
"""The name of DCP's attention in HF's ``AttentionInterface`` and ``AttentionMaskInterface``."""
TASK_KWARG = "dcp_task"
"""The keyword that carries the `TaskContext` through HF's forward to the attention calls."""
STASH_KWARG = "dcp_stash"
"""The keyword that carries a forward's `HostStash` (activation offload) to the layers' hooks."""

__all__ = ["ATTENTION", "DCPCausalLM", "HFTokenizer", "SUPPORTED_MODEL_TYPES", "check_supported",
           "enable", "is_hf_model", "load_causal_lm", "model_shape", "sliding_window"]


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a Transformers ``PreTrainedModel`` (importing nothing: a model of
    that class means its module is imported already)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def _longest(ctx: TaskContext) -> int:
    return max(ctx.layout.seq_lengths) if ctx.layout is not None else 0


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                 scaling: Optional[float] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature: ``query [B, Hq, T, D]``, ``key, value [B, Hkv, T, D]``
    -> ``(out [B, T, Hq, D], None)``.

    Inside a task (``kwargs["dcp_task"]``): `dcp_attention` on the local shard (``B == 1``);
    the task's layout decides which tokens attend, so a mask (other than the wrapper's empty
    one), dropout or a sliding window shorter than the task's longest sequence is refused.
    Outside a task: HF's SDPA attention with the mask HF built.
    """
    ctx = kwargs.pop(TASK_KWARG, None)
    kwargs.pop(STASH_KWARG, None)
    if ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    where = f"layer {getattr(module, 'layer_idx', '?')}, task {ctx.task.id}"
    if query.shape[0] != 1:
        raise ValueError(f"dcp attention ({where}): a task's shard is one row (batch 1), got "
                         f"batch {query.shape[0]}")
    if dropout:
        raise ValueError(f"dcp attention ({where}): attention dropout {dropout} is not supported "
                         "(the random stream would depend on the plan); set attention_dropout=0")
    if attention_mask is not None and attention_mask.numel():
        raise ValueError(f"dcp attention ({where}): an attention mask was given inside a task; "
                         "the plan's layout decides which tokens attend: pass no attention_mask "
                         "and call the model through DCPCausalLM, which passes the task")
    # Gemma's logit soft-capping and gpt-oss's attention sinks change the softmax itself.
    unsupported = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
    if unsupported:
        raise ValueError(f"dcp attention ({where}): {', '.join(unsupported)} is not supported "
                         "by DCP's attention")
    window = kwargs.get("sliding_window")
    if window is not None and _longest(ctx) > window:
        raise ValueError(f"dcp attention ({where}): sequence of {_longest(ctx)} tokens is longer "
                         f"than the sliding window {window}; DCP attends causally over the whole "
                         "sequence: cut sequences to the window or use a full-attention model")
    # [1, H, T, D] -> [T, H, D], the runtime's layout (a copy unless memory is already in it)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    out = dcp_attention(q, k, v, causal=getattr(module, "is_causal", True),
                        softmax_scale=scaling, task=ctx)
    return out.unsqueeze(0), None


class _TaskRecompute:
    """Decoder layer ``index``'s ``_gradient_checkpointing_func``: recompute the layer when
    ``index`` < the task's ``recompute_layers`` (`run_layer`), else run it as is.

    HF calls it with the layer's bound forward (a ``partial`` holding the keywords, the task
    among them) and the hidden state as the only positional argument.

    With the task's ``mlp_tiles`` > 1 the layer's MLP runs over tiles (`_TiledMLPForward`: set
    for the call, and again by the recompute, which calls the same `_WithMLPTiles`); with its
    ``offload_layers`` the layer's input waits in the forward's `HostStash` (``dcp_stash``).
    """

    def __init__(self, index: int, mlp_forward: Optional["_TiledMLPForward"] = None) -> None:
        self.index = index
        self.mlp_forward = mlp_forward

    def __call__(self, forward: Any, *args: Any) -> Any:
        keywords = forward.keywords if isinstance(forward, functools.partial) else {}
        task = keywords.get(TASK_KWARG)
        tiles = mlp_tiles_of(task)
        if tiles > 1 and self.mlp_forward is not None:
            forward = _WithMLPTiles(forward, self.mlp_forward, tiles)
        return run_layer(self.index, forward, *args, task=task, stash=keywords.get(STASH_KWARG))


class _TiledMLPForward(TileableForward):
    """A decoder layer's ``mlp.forward`` (HF: ``hidden [1, T, h] -> [1, T, h]``) over tiles of
    the tokens (`tiled_mlp`) while a layer call of a tiled task runs (`_WithMLPTiles`)."""

    def run_tiled(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            return self.forward(hidden_states, *args, **kwargs)
        return tiled_mlp(self.forward, hidden_states[0], self.tiles)[None]


class _WithMLPTiles:
    """A layer's bound forward run with its MLP tiled (kept by a recompute, so the recompute
    tiles the same way)."""

    def __init__(self, forward: Any, mlp_forward: _TiledMLPForward, tiles: int) -> None:
        self.layer_forward, self.mlp_forward, self.tiles = forward, mlp_forward, tiles

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.mlp_forward.tiled(self.tiles):
            return self.layer_forward(*args, **kwargs)


def _tiled_mlp_forward(layer: nn.Module) -> Optional[_TiledMLPForward]:
    """Layer's MLP forward made tileable in place (once), or ``None`` without an ``mlp``."""
    mlp = getattr(layer, "mlp", None)
    return _TiledMLPForward.install(mlp) if mlp is not None else None


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _check_recompute_hooks(layers: list[nn.Module]) -> None:
    for i, layer in enumerate(layers):
        hook = getattr(layer, "_gradient_checkpointing_func", None)
        if not (layer.gradient_checkpointing and isinstance(hook, _TaskRecompute)
                and hook.index == i):
            raise RuntimeError(
                f"decoder layer {i} lost DCP's per-task recompute hook "
                "(activation/gradient_checkpointing_enable or _disable after megatron_dcp."
                "integrations.hf.enable?): DCP sets each task's recompute_layers itself; remove "
                "that call or call enable(model) after it")


def sliding_window(config: Any) -> Optional[int]:
    """The smallest attention window of the model's layers (``None``: every layer attends to
    the whole sequence). Mistral applies ``sliding_window`` to every layer, Qwen2 only to layers
    its ``layer_types`` mark ``sliding_attention``."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def model_shape(model: nn.Module) -> ModelShape:
    """The planner's `ModelShape` of an HF causal LM (its text config and its modules: tied
    embeddings and q/k/v biases as the model has them; experts: `_moe_fields`); a dense one's
    layers keep what HF's eager layer saves (`megatron_dcp.plan.layer_memory`, ``hf-eager``)."""
    config = model.config.get_text_config()
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = next((m for m in model.modules() if hasattr(m, "q_proj")), None)
    qkv_bias = attention is not None and attention.q_proj.bias is not None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    return ModelShape(num_layers=int(config.num_hidden_layers),
                      hidden_size=int(config.hidden_size), num_heads=heads,
                      ffn_hidden_size=int(config.intermediate_size),
                      vocab_size=int(config.vocab_size),
                      num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                      head_dim=int(head_dim), tied_embeddings=tied, qkv_bias=qkv_bias,
                      gated_mlp=True, causal=True,
                      max_position=getattr(config, "max_position_embeddings", None),
                      name=str(getattr(config, "model_type", "hf")), **_moe_fields(config),
                      layer_memory=None if _moe_fields(config) else "hf-eager")


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")
"""The architectures tested under DCP: decoder-only, causal, RoPE positions per token, a gated
MLP (or gated experts: Mixtral, Qwen2-MoE, Qwen3-MoE, whose experts ZeRO shards like any
parameter), attention replaceable through transformers' ``AttentionInterface``."""
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Mixture-of-experts architectures: with ``output_router_logits`` and ``router_aux_loss_coef``
> 0 in their config, DCP adds the router's load-balancing loss per whole sequence
(`router_loss`)."""


def _num_experts(config: Any) -> int:
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
               or 0)


def _moe_fields(config: Any) -> dict:
    """`ModelShape` MoE keywords of an HF config (``{}``: dense): experts
    (``num_local_experts`` / ``num_experts``), top-k (``num_experts_per_tok``), one expert's FFN
    (``moe_intermediate_size``, Mixtral's ``intermediate_size``), the shared expert's
    (Qwen2-MoE's ``shared_expert_intermediate_size``), no expert parallelism (ZeRO shards the
    experts). Dense layers (Qwen2/3-MoE: in ``mlp_only_layers`` or off ``decoder_sparse_step``,
    an FFN of ``intermediate_size``) are counted as if they led: an interleaved layout is
    approximated by its number of dense layers (``moe_dense_layers`` means leading ones)."""
    experts = _num_experts(config)
    if not experts:
        return {}
    layers = int(config.num_hidden_layers)
    step = int(getattr(config, "decoder_sparse_step", None) or 1)
    only_mlp = set(getattr(config, "mlp_only_layers", None) or ())
    dense = sum(1 for i in range(layers) if i in only_mlp or (i + 1) % step)
    if dense >= layers:
        return {}  # every layer dense: a dense model of intermediate_size
    expert = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    return dict(num_experts=experts, moe_topk=int(config.num_experts_per_tok),
                moe_ffn_hidden_size=expert,
                moe_shared_expert_ffn=int(getattr(config, "shared_expert_intermediate_size",
                                                  None) or 0),
                moe_dense_layers=dense, expert_parallel=1)


def router_loss_enabled(config: Any) -> bool:
    """Whether the model's own config asks for the router's load-balancing loss (HF's switch:
    ``output_router_logits`` with ``router_aux_loss_coef`` > 0)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(_num_experts(config) and getattr(config, "output_router_logits", False)
                and float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) > 0)


def check_supported(config: Any, what: str = "the model") -> None:
    """Refuse an architecture outside `SUPPORTED_MODEL_TYPES`, naming it: an encoder (BERT)
    would train with bidirectional attention under a next-token loss (it sees the token it
    predicts), and others lack what the cost model reads (GPT-2 has no ``intermediate_size``)."""
    kind = getattr(config.get_text_config(), "model_type", None) or getattr(
        config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{what}: architecture {kind!r} ({type(config).__name__}) is not "
                         f"supported by DCP; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                         "(decoder-only causal LMs with RoPE and a gated MLP, as tested)")


def enable(model: nn.Module, *, max_sequence_length: Optional[int] = None) -> ModelShape:
    """Prepare an HF causal LM for DCP in place and return its `ModelShape`.

    Registers and selects the ``"dcp"`` attention, sets ``use_cache=False`` (a cache disables
    HF's packed-document detection and is useless in training), and makes each task recompute
    its first ``recompute_layers`` decoder layers. Refuses an architecture not in
    `SUPPORTED_MODEL_TYPES`, attention dropout > 0, a model whose attention cannot be replaced,
    and a sliding window shorter than ``max_sequence_length`` (when given; else each task checks
    its own sequences). Calling it again is harmless.
    """
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"enable() takes a transformers PreTrainedModel, got {type(model)}")
    check_supported(model.config, type(model).__name__)
    config = model.config.get_text_config()
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise ValueError(f"{type(model).__name__}: attention_dropout={dropout} is not supported "
                         "under DCP (dropout's random stream would depend on the plan); set it "
                         "to 0")
    window = sliding_window(config)
    if window is not None and max_sequence_length is not None and window < max_sequence_length:
        raise ValueError(f"{type(model).__name__}: sliding window {window} is shorter than the "
                         f"longest sequence ({max_sequence_length}); DCP attention is causal over "
                         "whole sequences: cut sequences to the window")
    # Registering under our own name (never overwriting "sdpa") leaves other models untouched.
    AttentionInterface.register(ATTENTION, hf_attention)
    # Outside a task (evaluation, generate) HF builds SDPA's mask; inside one it builds none.
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    if model.config._attn_implementation != ATTENTION:
        raise ValueError(f"{type(model).__name__} does not support replacing its attention "
                         "function (transformers' AttentionInterface): not supported by DCP")
    model.config.use_cache = False
    layers = _decoder_layers(model)
    if len(layers) != int(config.num_hidden_layers):
        raise ValueError(f"{type(model).__name__}: found {len(layers)} decoder layers, the config "
                         f"has num_hidden_layers={config.num_hidden_layers}")
    for i, layer in enumerate(layers):
        # HF calls the hook only when the flag is set (and in training with grad enabled); the
        # hook then recomputes if i < the task's recompute_layers, which may be 0.
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = _TaskRecompute(i, _tiled_mlp_forward(layer))
    return model_shape(model)


class DCPCausalLM(nn.Module):
    """An HF causal LM with the runtime's forward: ``(input_ids [T], position_ids [T], task)
    -> logits [T, V]`` (what `StepDriver` engines and `deepspeed_plugin` call).

    The wrapper registers the HF model's own children (``model``, ``lm_head`` ...) under their
    own names, so its parameter names and state-dict keys are the HF model's and a DeepSpeed
    checkpoint loads into it directly; ``causal_lm`` is the HF model (``save_pretrained``,
    ``generate``). ``enable`` runs on construction.
    """

    def __init__(self, causal_lm: nn.Module, *,
                 max_sequence_length: Optional[int] = None) -> None:
        super().__init__()
        self._shape = enable(causal_lm, max_sequence_length=max_sequence_length)
        self.router_loss_scale = 1.0
        """The factor the engine multiplies every micro-step's loss by before backward (the
        DeepSpeed plugin: the world size, turning DeepSpeed's average into a sum): the router's
        load-balancing loss, which joins backward inside the model, is scaled alike."""
        self.__dict__["causal_lm"] = causal_lm  # not a child: that would prefix every key
        self._layers = _decoder_layers(causal_lm)  # a plain list: registers nothing
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        for name, param in causal_lm.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in causal_lm.named_buffers(recurse=False):
            self.register_buffer(name, buf,
                                 persistent=name not in causal_lm._non_persistent_buffers_set)
        self.train(causal_lm.training)

    def shape(self) -> ModelShape:
        """The model's shape for the planner's cost model."""
        return self._shape

    def train(self, mode: bool = True) -> "DCPCausalLM":
        """Train/eval mode of the wrapper and of the HF model itself (not a child)."""
        self.causal_lm.train(mode)
        return super().train(mode)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                task: Optional[TaskContext] = None,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[T, V]`` of the tokens ``input_ids [T]`` at ``position_ids [T]`` (default
        0..T-1: one whole sequence), as the local shard of ``task`` (``None``: outside a
        task). With ``labels [T]``: the token losses ``[T]`` (`token_losses`: over the task's
        loss tiles), computed inside this call (where ZeRO-3 has the head gathered)."""
        if labels is not None:
            return self.token_losses(input_ids, position_ids, labels, task)
        if self._router_loss_wanted(task):  # the base model: HF's head would add its own
            output = self._call(self.causal_lm.base_model, input_ids, position_ids, task)
            logits = self.causal_lm.get_output_embeddings()(output.last_hidden_state[0])
            return self._with_router_loss(logits, output, task)
        return self._call(self.causal_lm, input_ids, position_ids, task).logits[0]

    def _router_loss_wanted(self, task: Optional[TaskContext]) -> bool:
        return task is not None and self.training and torch.is_grad_enabled() \
            and router_loss_enabled(self.causal_lm.config)

    def _with_router_loss(self, out: torch.Tensor, output: Any,
                          task: Optional[TaskContext]) -> torch.Tensor:
        """``out``, carrying the router's load-balancing loss of the task's whole sequences
        (`megatron_dcp.runtime.moe.sequence_balancing_loss`: its gradient joins backward of
        ``out``) when the config asks for it; ``out`` unchanged otherwise."""
        if not self._router_loss_wanted(task):
            return out
        from megatron_dcp.runtime.moe import AttachLoss, sequence_balancing_loss

        config = self.causal_lm.config.get_text_config()
        logits = [g for g in (output.router_logits or ()) if g is not None]
        loss = sequence_balancing_loss(logits, int(config.num_experts_per_tok), task,
                                       float(config.router_aux_loss_coef))
        return AttachLoss.apply(out, loss, self.router_loss_scale)

    def _call(self, module: nn.Module, input_ids: torch.Tensor,
              position_ids: Optional[torch.Tensor], task: Optional[TaskContext]) -> Any:
        position_ids, ctx = check_inputs("DCPCausalLM", input_ids, position_ids, task)
        _check_recompute_hooks(self._layers)
        kwargs: dict[str, Any] = {}
        if ctx is not None:
            # an empty 4-D mask: HF builds none (nor searches the positions for packed
            # sequences, a sync); the task's layout decides who attends
            kwargs = {TASK_KWARG: ctx, "attention_mask": torch.empty(
                1, 1, 0, 0, dtype=torch.bool, device=input_ids.device)}
            stash = stash_for(ctx)
            if stash is not None:
                kwargs[STASH_KWARG] = stash
            if self._router_loss_wanted(ctx):
                kwargs["output_router_logits"] = True
        return module(input_ids=input_ids[None], position_ids=position_ids[None],
                      use_cache=False, **kwargs)

    def token_losses(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                     labels: torch.Tensor, task: Optional[TaskContext] = None) -> torch.Tensor:
        """Cross-entropy of every token ``[T]`` (0 where ``labels == -100``); with the task's
        ``loss_tiles`` > 1 the output projection and loss run over tiles (`tiled_logits_loss`:
        no ``[T, V]`` logits)."""
        from megatron_dcp.models.common import token_losses

        tiles = loss_tiles_of(task)
        head = self.causal_lm.get_output_embeddings()
        if tiles <= 1 or head is None or getattr(self.causal_lm.config, "final_logit_softcapping",
                                                  None):
            return token_losses(self.forward(input_ids, position_ids, task), labels)
        hidden = self._call(self.causal_lm.base_model, input_ids, position_ids, task)
        last = self._with_router_loss(hidden.last_hidden_state[0], hidden, task)
        return tiled_logits_loss(last, head.weight, labels, tiles,
                                 token_losses, getattr(head, "bias", None))


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM of a local HF directory: its weights when it has them, else initialised at
    random from its ``config.json`` (seed torch first: every rank must build the same model).
    Nothing is downloaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json (a local Hugging Face model directory)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_supported(config, path)  # before building it
    if any(os.path.exists(os.path.join(path, name)) for name in WEIGHT_FILES):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


class HFTokenizer:
    """A local HF tokenizer with `megatron_dcp.data.ByteTokenizer`'s interface (``encode``,
    ``vocab_size``), so the data code (embedded corpus, jsonl) takes either."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tokenizer)
        self.eod = self.tokenizer.eos_token_id
        """End of document (the tokenizer's EOS; ``None`` if it has none)."""

    def encode(self, text: str, append_eod: bool = True) -> np.ndarray:
        """Token ids of ``text`` (with the tokenizer's special tokens), EOS appended unless
        ``append_eod`` is False."""
        ids = self.tokenizer(text)["input_ids"]
        if append_eod and self.eod is not None:
            ids = ids + [self.eod]
        return np.asarray(ids, dtype=np.int64)
