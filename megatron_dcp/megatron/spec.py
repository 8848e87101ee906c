"""A GPT layer spec whose core attention is DCP's, and RoPE that follows a shard's tokens.

Core attention enters through Megatron's own extension point, the layer spec
(``ModuleSpec.submodules.self_attention.submodules.core_attention``), the way Transformer Engine
plugs in; no Megatron file is edited. `DCPCoreAttention` calls
`megatron_dcp.runtime.attention.dcp_attention`, which reads the current task (group, Ulysses/ring
layout, which tokens belong to which packed sequence) and runs Ulysses, ring or both; it uses
flash-attn varlen kernels where installed and an exact torch kernel otherwise, so no Transformer
Engine is needed.

RoPE positions. ``GPTModel`` computes rotary frequencies itself, for positions ``0..S-1`` of the
input it is given (``RotaryEmbedding(seq_len)``; ``position_ids`` are only read by learned
absolute embeddings), and ``SelfAttention`` rotates q/k *before* core attention. A DCP shard's
tokens are neither contiguous nor from one sequence (zigzag ring chunks, Ulysses pieces, several
packed sequences), so positions ``0..S-1`` would be wrong. Options considered:

* Megatron's THD path (``packed_seq_params`` with cu_seqlens) restarts positions per sequence,
  but slices them with Megatron's own CP chunk order (chunks r and 2cp-r-1 of the rotary table
  per sequence), which is not DCP's layout (zigzag over ring x contiguous over Ulysses);
* applying RoPE inside core attention needs ``position_embedding_type='none'`` and duplicates
  Megatron's RoPE variants (base, percent, interleaving, scaling);
* **chosen:** `DCPRotaryEmbedding` wraps the model's own ``RotaryEmbedding``. Inside a task it
  returns the frequency table indexed by the shard's original positions
  (``layout.position_ids``), shape ``[T_local, 1, 1, dim]``; Megatron's bshd rotation applies
  row t to token t, so every token is rotated by its position in its own sequence. Outside a
  task it is Megatron's module unchanged. The model is called in bshd (batch 1) under DCP; the
  packing lives in the layout.

The task reaches core attention explicitly: the DCP step hands every micro-batch a
`DCPTaskParams` (Megatron's ``PackedSeqParams`` in the plain ``sbhd`` format, plus the task);
a ``forward_step_func`` that passes it to the model as ``packed_seq_params=`` (as Megatron's
own ``pretrain_gpt.py`` passes its packed parameters) gets it to every layer's core attention,
also in a recompute that Megatron's reentrant checkpoint runs in backward on CUDA's autograd
thread. Without it, core attention falls back to `current_task`.

`prepared_model(model)` installs the RoPE wrapper and the dynamic CP groups (`parallel`) for one
step and undoes both; the DCP step uses it, so users rarely need to.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

from megatron_dcp.runtime.context import TaskContext, current_task


def _packed_seq_params_class():
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams


@dataclass
class DCPTaskParams(_packed_seq_params_class()):
    """Megatron's ``PackedSeqParams`` (format ``sbhd``: one packed row per shard) carrying the
    DCP task to `DCPCoreAttention` through the model's ``packed_seq_params`` argument."""

    task: Any = None
    """The `TaskContext` of the shard."""

    @classmethod
    def of(cls, task: Optional[TaskContext]) -> Optional["DCPTaskParams"]:
        """Parameters for ``task`` (``None`` outside a task)."""
        if task is None or task.layout is None:
            return None
        n = task.layout.num_tokens
        # max_seqlen_*: what GPTModel asks the rotary embedding for (our wrapper reads the
        # task's positions instead); no cu_seqlens: the layout describes the packing.
        return cls(qkv_format="sbhd", max_seqlen_q=n, max_seqlen_kv=n, task=task)


def get_gpt_layer_dcp_spec(normalization: Optional[str] = "RMSNorm", qk_layernorm: bool = False,
                           use_transformer_engine: Optional[bool] = None):
    """Megatron-core GPT layer spec with `DCPCoreAttention` as core attention.

    The rest of the layer comes from Megatron's Transformer Engine spec when TE is installed
    (``use_transformer_engine=None``: detect) or its local spec (pure torch) otherwise.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine is None:
        use_transformer_engine = bool(getattr(gpt_layer_specs, "HAVE_TE", False))
    if use_transformer_engine:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization,
                                                        qk_layernorm=qk_layernorm)
    attention = spec.submodules.self_attention
    if not hasattr(attention.submodules, "core_attention"):
        raise TypeError(f"get_gpt_layer_dcp_spec: {attention.module} has no core_attention slot")
    attention.submodules.core_attention = DCPCoreAttention
    return spec


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class DCPCoreAttention(_megatron_module()):
    """Core attention (after q/k/v projection and RoPE) running DCP's sequence-parallel attention.

    Same constructor and call signature as Megatron's ``DotProductAttention``. Inputs are
    ``[s, b, heads, dim]`` (bshd) or ``[t, heads, dim]`` (THD with ``packed_seq_params``); GQA
    key/value heads are passed through un-expanded. Inside a task the batch must be 1 (the
    task's packed shard). Outside a task: plain attention per batch row, or per packed sequence
    with THD ``packed_seq_params`` (run as a one-rank task).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None) -> None:
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType

        self.layer_number = layer_number
        self.causal = attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(head_dim))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None):
        """Attention output, ``[s, b, heads*dim]`` (bshd) or ``[t, heads*dim]`` (THD)."""
        from megatron_dcp.runtime.attention import dcp_attention

        if self.dropout > 0 and self.training:
            raise ValueError(f"DCPCoreAttention (layer {self.layer_number}): attention dropout "
                             f"{self.dropout} would make the result depend on the plan; set "
                             "attention_dropout=0")
        if attention_bias is not None:
            raise ValueError("DCPCoreAttention: attention_bias is not supported")
        causal = self.causal
        if attn_mask_type is not None:
            from megatron.core.transformer.enums import AttnMaskType

            causal = attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)

        task = current_task(getattr(packed_seq_params, "task", None))

        # Megatron's --deterministic-mode; else torch's use_deterministic_algorithms decides
        deterministic = True if getattr(self.config, "deterministic_mode", False) else None

        def attend(q, k, v, task=task):
            return dcp_attention(q, k, v, causal=causal, softmax_scale=self.softmax_scale,
                                 task=task, deterministic=deterministic)

        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            out = self._thd(query, key, value, packed_seq_params, attend, task)
            return out.reshape(out.shape[0], -1)
        seq, batch = query.shape[:2]
        if task is not None:
            if batch != 1:
                raise ValueError(f"DCPCoreAttention: a DCP task runs one packed shard (batch 1), "
                                 f"got batch {batch}")
            out = attend(query[:, 0], key[:, 0], value[:, 0]).unsqueeze(1)
        else:
            if attention_mask is not None and not causal:
                raise ValueError("DCPCoreAttention: explicit attention masks are not supported; "
                                 "use causal attention or THD packed_seq_params")
            out = torch.stack([attend(query[:, b], key[:, b], value[:, b]) for b in range(batch)],
                              dim=1)
        return out.reshape(seq, batch, -1)

    @staticmethod
    def _thd(query, key, value, packed_seq_params, attend, task):
        # Outside DCP: Megatron's THD packing as a one-rank task whose layout has these sequences.
        if task is not None:
            raise ValueError("DCPCoreAttention: do not pass THD packed_seq_params inside a DCP "
                             "task; the task's layout already describes the packing")
        from megatron_dcp.plan.plan import Task
        from megatron_dcp.runtime.layout import ShardLayout

        cu = packed_seq_params.cu_seqlens_q.tolist()
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        layout = ShardLayout.build(lengths, ulysses=1, ring=1, group_rank=0)
        one_rank = Task(id=-1, ranks=(0,), seqs=tuple(range(len(lengths))))
        return attend(query, key, value, TaskContext(task=one_rank, group_rank=0, layout=layout))


class DCPRotaryEmbedding(nn.Module):
    """Megatron's ``RotaryEmbedding`` whose table follows the shard's tokens inside a DCP task.

    Inside a task: frequencies for ``layout.position_ids`` (``[T_local, 1, 1, dim]``). Outside:
    exactly the wrapped module's output. Other attributes are the wrapped module's.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> torch.Tensor:
        """Rotary table: by the task's original positions, else Megatron's own."""
        ctx = current_task()
        if ctx is None or ctx.layout is None:
            return self.inner(max_seq_len, offset, packed_seq, cp_group)
        # The table's length from the host positions, the index from the layout's device copy
        # (pinned, asynchronous, made once per shard): no device sync and no pageable copy.
        host = ctx.layout.position_ids
        table = self.inner.get_emb(int(host.max()) + 1 if host.numel() else 1, offset)
        return table[ctx.layout.meta().to(table.device).positions]

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


@contextmanager
def prepared_model(model) -> Iterator[Any]:
    """``with prepared_model(model):`` `prepare_model` for the block, undone on exit (unless the
    model was prepared before)."""
    from megatron_dcp.megatron.parallel import restore_pg_collections

    inner = _unwrap(model)
    rope = getattr(inner, "rotary_pos_emb", None)
    already = isinstance(rope, DCPRotaryEmbedding)
    prepare_model(model)
    try:
        yield model
    finally:
        if not already:
            wrapped = getattr(inner, "rotary_pos_emb", None)
            if isinstance(wrapped, DCPRotaryEmbedding):
                inner.rotary_pos_emb = wrapped.inner
            restore_pg_collections(inner)


def prepare_model(model) -> None:
    """Make a (DDP-wrapped) Megatron GPT model DCP-ready: task-following RoPE and CP groups.

    Idempotent. Raises when the core attention is not DCP's (the model was built without
    `get_gpt_layer_dcp_spec`), since Megatron's attention would silently ignore the task.
    """
    from megatron_dcp.megatron.parallel import make_pg_collections_dynamic

    inner = _unwrap(model)
    if not any(isinstance(m, DCPCoreAttention) for m in inner.modules()):
        raise TypeError("the model's core attention is not DCPCoreAttention: build it with "
                        "megatron_dcp.megatron.get_gpt_layer_dcp_spec()")
    rope = getattr(inner, "rotary_pos_emb", None)
    if rope is not None and not isinstance(rope, DCPRotaryEmbedding):
        if not hasattr(rope, "get_emb"):
            raise TypeError(f"DCP supports RoPE via Megatron's RotaryEmbedding, got "
                            f"{type(rope).__name__}")
        inner.rotary_pos_emb = DCPRotaryEmbedding(rope)
    make_pg_collections_dynamic(inner)
