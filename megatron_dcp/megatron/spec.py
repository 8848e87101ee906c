"""A GPT layer spec whose core attention and layers are DCP's; the task arrives as an argument.

Everything enters through Megatron's own extension point, the layer spec (the way Transformer
Engine plugs in): `get_gpt_layer_dcp_spec` puts `DCPCoreAttention` in the ``core_attention`` slot
and `DCPTransformerLayer` in place of ``TransformerLayer``. No Megatron file is edited and nothing
is patched. The task reaches them as the model's ``packed_seq_params``: the DCP step hands every
micro-batch a `DCPTaskParams` (Megatron's ``PackedSeqParams`` in the plain ``sbhd`` format, plus
the task and its recomputed layers), which a ``forward_step_func`` passes to the model (as
Megatron's own ``pretrain_gpt.py`` passes its packed parameters) and Megatron hands to every
layer and every core attention, also when a recompute re-runs a layer in backward on CUDA's
autograd thread (the arguments are saved with the checkpoint).

`DCPCoreAttention` calls `megatron_dcp.runtime.attention.dcp_attention` with the task (group,
Ulysses/ring layout, which tokens belong to which packed sequence): Ulysses, ring or both, with
flash-attn varlen kernels where installed and an exact torch kernel otherwise; no Transformer
Engine is needed.

RoPE positions. ``GPTModel`` computes the rotary table itself, for positions ``0..S-1`` with
``S = max(max_seqlen_q, max_seqlen_kv)`` of ``packed_seq_params``, and ``SelfAttention`` rotates
q/k *before* core attention. A DCP shard's tokens are neither contiguous nor from one sequence
(zigzag ring chunks, Ulysses pieces, several packed sequences). Options considered:

* Megatron's THD path (cu_seqlens) restarts positions per sequence, but slices them with
  Megatron's own CP chunk order (chunks r and 2cp-r-1 per sequence), which is not DCP's layout;
* applying RoPE inside core attention needs ``position_embedding_type='none'`` and duplicates
  Megatron's RoPE variants (base, percent, interleaving, scaling);
* **chosen:** `DCPTaskParams` sets ``max_seqlen_q`` to the shard's largest position + 1
  rounded up to a power of two (`rope_table_length`), so Megatron's own ``RotaryEmbedding``
  builds the table of every position the shard holds, and
  `DCPTransformerLayer` hands its attention the rows of the shard's tokens (``layout.position_ids``,
  ``[T_local, 1, 1, dim]``); Megatron's bshd rotation applies row t to token t. The model runs in
  bshd (batch 1) under DCP; the packing lives in the layout. ``RotaryEmbedding.forward`` is an
  ``lru_cache`` of 32 tables on the GPU: with a length per shard it kept up to 32 tables of
  different sizes alive (at 128K positions, 64 MB each), which no memory model counts; rounded
  to powers of two, the tables it keeps are at most one per power, together less than twice
  the largest (`rope_table_length`): 128 MB at 128K positions and head dim 128, inside the
  memory model's fixed reserve.

Recompute depth. `DCPTransformerLayer` runs itself under Megatron's reentrant checkpoint
(``tensor_parallel.checkpoint``, as Megatron's block recompute does per layer) when its index is
below ``packed_seq_params.recompute_layers``: the depth of the task, read per call, so the
``TransformerConfig`` is never changed (its ``recompute_granularity`` must be unset under DCP).

Sequence parallelism (``sequence_parallel`` with TP > 1). Megatron splits the layer inputs along
the sequence over the TP ranks, so a shard's length must be a multiple of TP: the step pads the
shard at its end (``DCPTaskParams.sp_pad`` tokens, label masked). Between the TP all-gather and
reduce-scatter every TP rank holds the whole padded shard; `DCPCoreAttention` hands only the
shard's own tokens to DCP's attention and returns zeros for the padding, which therefore neither
attends nor is attended to, and carries no loss: exact. The norms must accept SP: `SPNorm`
(torch's ``RMSNorm``/``LayerNorm`` with weights marked ``sequence_parallel`` so Megatron's
``finalize_model_grads`` sums their gradients over TP) replaces Megatron's ``WrappedTorchNorm``,
which refuses SP, in the local spec; `get_gpt_block_dcp_spec` also puts it in the final norm.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.offload import OffloadEntry, offload_layers_of, stash_for
from megatron_dcp.runtime.tiling import TileableForward, mlp_tiles_of, tiled_mlp


class TaskRun:
    """One run of a shard's micro-batch through the model (one model chunk under virtual
    pipeline stages), which the engine that starts it (`MegatronStepEngine`) owns and reads
    back; the layers get it from the run's `DCPTaskParams`, which they only read."""

    __slots__ = ("stash", "reached")

    def __init__(self, stash: Any = None) -> None:
        self.stash = stash
        """The `megatron_dcp.runtime.offload.HostStash` of this forward (the task's
        ``offload_layers`` > 0 in training), where offloaded layers keep their saved input."""
        self.reached = False
        """Set by the first `DCPTransformerLayer` that runs the micro-batch: the engine checks
        it to name a ``forward_step_func`` that did not pass ``packed_seq_params`` on."""

    @classmethod
    def of(cls, task: Optional[TaskContext], train: bool = True) -> "TaskRun":
        """A run of ``task``'s micro-batch, with a stash where ``train`` and it offloads."""
        return cls(stash_for(task) if train else None)


@dataclass
class DCPTaskParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` (format ``sbhd``: one packed row per shard) carrying the
    DCP task to `DCPTransformerLayer` and `DCPCoreAttention` through the model's
    ``packed_seq_params`` argument. Input only, as Megatron's: what a run leaves (the layers
    reached, the offload stash) is in its `TaskRun`."""

    task: Any = None
    """The `TaskContext` of the shard."""
    recompute_layers: int = 0
    """Recompute the first ``recompute_layers`` layers in this call (the task's depth; 0 in a
    forward-only step)."""
    sp_pad: int = 0
    """Padding tokens at the end of the shard's micro-batch that make its length a multiple of
    the TP size under sequence parallelism (outside DCP's layout: attention skips them)."""
    run: TaskRun = field(default_factory=TaskRun)
    """The run of the micro-batch these parameters belong to (the engine's `TaskRun`)."""

    @classmethod
    def of(cls, task: Optional[TaskContext], train: bool = True, sp_pad: int = 0,
           run: Optional[TaskRun] = None) -> Optional["DCPTaskParams"]:
        """Parameters for ``task`` (``None`` outside a task); ``train=False``: no recompute;
        ``sp_pad``: see the field; ``run``: the engine's record of the run (default: a new
        `TaskRun.of` the task)."""
        if task is None or task.layout is None:
            return None
        # GPTModel asks its RotaryEmbedding for the table of positions 0..max_seqlen-1: every
        # position of the shard (host positions: no device sync); no cu_seqlens: the layout
        # describes the packing.
        host = task.layout.position_ids
        n = rope_table_length(int(host.max()) + 1 if host.numel() else 1)
        return cls(qkv_format="sbhd", max_seqlen_q=n, max_seqlen_kv=n, task=task,
                   recompute_layers=task.recompute_layers if train else 0, sp_pad=sp_pad,
                   run=run if run is not None else TaskRun.of(task, train))

    def rotary_rows(self, table):
        """The rows of Megatron's rotary table ``[max_seqlen_q, 1, 1, dim]`` (or of each of a
        (q, k) pair) at the shard's positions, ``[T_local, 1, 1, dim]``: indexed by the layout's
        pinned device copy, made once per shard (no device sync, no pageable copy); position 0
        for the ``sp_pad`` padding rows."""
        if isinstance(table, (tuple, list)):
            return type(table)(self.rotary_rows(t) if t is not None else None for t in table)
        rows = table[self.task.layout.meta().to(table.device).positions]
        if self.sp_pad:
            rows = torch.cat([rows, table[:1].expand(self.sp_pad, *table.shape[1:])])
        return rows


ROPE_MIN_TABLE = 64
"""The shortest rotary table `DCPTaskParams` asks for."""


def rope_table_length(positions: int) -> int:
    """Rows of the rotary table a shard asks Megatron for: its ``positions`` rounded up to a
    power of two (at least `ROPE_MIN_TABLE`), so Megatron's cached tables are a handful of sizes
    whose sum stays below twice the largest, not one per shard length."""
    return max(ROPE_MIN_TABLE, 1 << max(0, int(positions) - 1).bit_length())


def get_gpt_layer_dcp_spec(normalization: Optional[str] = "RMSNorm", qk_layernorm: bool = False,
                           use_transformer_engine: Optional[bool] = None,
                           num_experts: Optional[int] = None, moe_grouped_gemm: bool = False):
    """Megatron-core GPT layer spec with `DCPTransformerLayer` and `DCPCoreAttention`.

    The rest of the layer comes from Megatron's Transformer Engine spec when TE is installed
    (``use_transformer_engine=None``: detect) or its local spec (pure torch) otherwise. Checks
    the megatron-core version first (`megatron_dcp.patching.check_version`). ``num_experts``:
    an MoE layer (Megatron's, ``moe_grouped_gemm`` as Megatron's spec takes it) whose router is
    `megatron_dcp.megatron.moe.DCPTopKRouter` (auxiliary losses independent of the plan).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_dcp.patching import check_version

    check_version("megatron-core", "get_gpt_layer_dcp_spec")

    if use_transformer_engine is None:
        use_transformer_engine = bool(getattr(gpt_layer_specs, "HAVE_TE", False))
    moe = {} if not num_experts else {"num_experts": num_experts,
                                      "moe_grouped_gemm": moe_grouped_gemm}
    if use_transformer_engine:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm,
                                                                          **moe)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization,
                                                        qk_layernorm=qk_layernorm, **moe)
    if num_experts:
        from megatron_dcp.megatron.moe import use_dcp_router

        use_dcp_router(spec)
    attention = spec.submodules.self_attention
    if spec.module is not TransformerLayer or not hasattr(attention.submodules, "core_attention"):
        raise TypeError(f"get_gpt_layer_dcp_spec: expected Megatron's TransformerLayer with a "
                        f"core_attention slot, got {spec.module} / {attention.module}")
    spec.module = DCPTransformerLayer
    attention.submodules.core_attention = DCPCoreAttention
    if not use_transformer_engine:
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            if _is_torch_norm(getattr(spec.submodules, name, None)):
                setattr(spec.submodules, name, SPNorm)
    return spec


def get_gpt_block_dcp_spec(config, layer_spec=None, vp_stage: Optional[int] = None,
                           pp_rank: Optional[int] = None):
    """Megatron's ``TransformerBlockSubmodules`` for this pipeline stage: ``layer_spec``
    (default `get_gpt_layer_dcp_spec` with ``config.normalization``) for each of its layers and
    `SPNorm` as the final norm where Megatron's block would use ``WrappedTorchNorm`` (no TE, no
    Apex), which refuses sequence parallelism. Pass it to ``GPTModel`` as the layer spec; needed
    with ``config.sequence_parallel`` where TE and Apex are absent (`get_gpt_layer_dcp_spec`
    alone covers the layers' norms, not the final one). ``pp_rank``: this pipeline rank, where
    Megatron's parallel state is not yet set up (megatron-core 0.19)."""
    from megatron.core.transformer import transformer_block as tb

    if layer_spec is None:
        layer_spec = get_gpt_layer_dcp_spec(normalization=config.normalization)
    stage = {} if pp_rank is None else {"pp_rank": pp_rank}
    layers = tb.get_num_layers_to_build(config, vp_stage=vp_stage, **stage)
    norm = SPNorm if _is_torch_norm(tb.LayerNormImpl) else tb.LayerNormImpl
    return tb.TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=norm)


def _is_torch_norm(module) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return module is WrappedTorchNorm


class SPNorm:
    """torch's ``RMSNorm`` or ``LayerNorm`` (``config.normalization``) that supports Megatron's
    sequence parallelism: built like Megatron's ``WrappedTorchNorm`` (which refuses SP), with
    every weight marked ``sequence_parallel = config.sequence_parallel``, so that
    ``finalize_model_grads`` sums its gradient over the TP ranks (each normalised a part of the
    sequence). Parameter names are torch's (``weight``, ``bias``): checkpoints of the local spec
    load unchanged."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("SPNorm: zero_centered_gamma and memory_efficient_layer_norm need "
                             "Transformer Engine or Apex norms")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"SPNorm: normalization {config.normalization!r} is not one of "
                             f"{sorted(kinds)}")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class DCPTransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer`` that runs a DCP task given as ``packed_seq_params``.

    With a `DCPTaskParams`: RoPE rows of the shard's positions, and the layer recomputed in
    backward when its index is below ``recompute_layers``. Otherwise Megatron's layer unchanged.
    The index counts within the pipeline stage: with pipeline parallelism a task's depth is that
    of one stage (Megatron's ``layer_number`` adds the stage's offset); with virtual stages the
    stage's chunks count in order (chunk ``c``'s layers follow those of chunks ``0..c-1``).
    """

    def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs) -> None:
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.block_index = layer_number - 1 + _earlier_chunk_layers(config,
                                                                    kwargs.get("vp_stage"))
        """Index of the layer in this pipeline stage (its chunks in order), from 0."""
        self._mlp_tiles = _tileable_mlp(self)
        """The MLP's tileable forward (`TiledMLPForward`; ``None``: MoE, not tiled)."""
        from megatron_dcp.megatron.moe import dcp_router_of

        self._router = dcp_router_of(self)
        """The MoE MLP's `DCPTopKRouter` (``None``: a dense MLP, or another router)."""

    def forward(self, *args, **kwargs):
        """Megatron's layer forward (``hidden_states, ..., packed_seq_params=...``)."""
        params = kwargs.get("packed_seq_params")
        if getattr(params, "task", None) is None:
            return super().forward(*args, **kwargs)
        params.run.reached = True
        rope = kwargs.get("rotary_pos_emb")
        if rope is not None:
            kwargs["rotary_pos_emb"] = params.rotary_rows(rope)
        if not (self.training and torch.is_grad_enabled()
                and self.block_index < params.recompute_layers):
            return self._run(params, *args, **kwargs)
        return self._recomputed(*args, **kwargs)

    def _run(self, params, *args, **kwargs):
        """Megatron's layer forward running the task of ``params``: an MoE router routes the
        task's tokens (`DCPTopKRouter.routing_task`) and a dense MLP runs over the task's
        ``mlp_tiles`` tiles, both set for this call only, on whichever thread runs it (a
        recompute runs it again)."""
        tiles = mlp_tiles_of(params.task)
        tiled = tiles > 1 and self._mlp_tiles is not None
        if tiled and not self._mlp_tiles.tileable:
            raise ValueError(f"layer {self.block_index}: task {params.task.id} has "
                             f"mlp_tiles {tiles}, but this layer's MLP is not Megatron's dense "
                             "MLP (MoE layers are not tiled)")
        routing = nullcontext() if self._router is None else self._router.routing_task(params)
        tiling = self._mlp_tiles.tiled(tiles) if tiled else nullcontext()
        with routing, tiling:
            return super().forward(*args, **kwargs)

    def _recomputed(self, *args, **kwargs):
        from megatron.core import tensor_parallel

        if args:
            kwargs["hidden_states"], args = args[0], args[1:]
        # The tensors go through the checkpoint (saved for backward); the rest in the closure.
        names = ("hidden_states", "attention_mask", "context", "context_mask", "rotary_pos_emb")
        tensors = [kwargs.pop(name, None) for name in names]
        params = kwargs.get("packed_seq_params")

        def run(*values):
            return self._run(params, *args, **dict(zip(names, values)), **kwargs)

        stash = params.run.stash
        if stash is None or self.block_index >= offload_layers_of(params.task):
            return tensor_parallel.checkpoint(run, self.config.distribute_saved_activations,
                                              *tensors)
        # Offloaded: Megatron's own recompute, its saved layer input kept in host memory
        return offloaded_saved_input(
            lambda: tensor_parallel.checkpoint(run, self.config.distribute_saved_activations,
                                               *tensors), tensors[0], stash)


class TiledMLPForward(TileableForward):
    """A layer's ``mlp.forward`` (Megatron's dense MLP: ``(hidden [s, b, h]) -> (out, bias)``)
    over the tiles of the sequence dimension (`tiled_mlp`: each tile recomputed in backward)
    while `DCPTransformerLayer` runs a tiled task. Token-wise, so exact; with sequence
    parallelism every tensor-parallel rank tiles its own part alike (fc1 gathers the tile of
    every rank, fc2 scatters them back)."""

    def run_tiled(self, hidden_states, *args, **kwargs):
        if args or any(v is not None for v in kwargs.values()):
            return self.forward(hidden_states, *args, **kwargs)
        bias: list = [None]

        def tile(x):
            out, bias[0] = self.forward(x)
            return out

        return tiled_mlp(tile, hidden_states, self.tiles), bias[0]


def _tileable_mlp(layer) -> Optional[TiledMLPForward]:
    """Install `TiledMLPForward` as the layer's ``mlp.forward`` (``tileable``: Megatron's dense
    ``MLP``; an MoE layer's is installed untileable, so a tiled task names it)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return None
    from megatron.core.transformer.mlp import MLP

    return TiledMLPForward.install(mlp, tileable=type(mlp) is MLP)


def offloaded_saved_input(checkpoint, hidden, stash):
    """``checkpoint()`` (Megatron's ``tensor_parallel.checkpoint`` of one layer) with the layer
    input ``hidden`` it saves for backward kept in ``stash`` (host memory) instead of on the
    device: a saved-tensor hook moves it there in forward, and its recompute in backward reads
    it back (`HostStash.get`, which prefetches the layer before). Megatron's recompute is
    otherwise unchanged (its RNG states, tracker included, are restored as without offload)."""
    entries = []

    def pack(t):
        if not entries and t.data_ptr() == hidden.data_ptr() and t.shape == hidden.shape \
                and t.dtype == hidden.dtype:
            entry = stash.put(t)
            entries.append(entry)
            return entry
        return t

    def unpack(packed):
        return packed.stash.get(packed) if isinstance(packed, OffloadEntry) else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = checkpoint()
    for entry in entries:
        stash.release(entry)
    return out


def _earlier_chunk_layers(config, vp_stage: Optional[int]) -> int:
    """Layers of this pipeline stage's model chunks before chunk ``vp_stage`` (0 without
    virtual stages)."""
    if not vp_stage:
        return 0
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    return sum(get_num_layers_to_build(config, vp_stage=c) for c in range(vp_stage))


class DCPCoreAttention(MegatronModule):
    """Core attention (after q/k/v projection and RoPE) running DCP's sequence-parallel attention.

    Same constructor and call signature as Megatron's ``DotProductAttention``. Inputs are
    ``[s, b, heads, dim]`` (bshd) or ``[t, heads, dim]`` (THD with ``packed_seq_params``); GQA
    key/value heads are passed through un-expanded. Inside a task the batch must be 1 (the
    task's packed shard). The task comes from ``packed_seq_params`` (a `DCPTaskParams`); without
    it: plain attention per batch row, or per packed sequence with THD ``packed_seq_params`` (run
    as a one-rank task).
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

        task = getattr(packed_seq_params, "task", None)

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
            own = seq - packed_seq_params.sp_pad  # SP padding: outside the layout, zeros
            out = attend(query[:own, 0], key[:own, 0], value[:own, 0]).unsqueeze(1)
            if own < seq:
                out = torch.cat([out, out.new_zeros(seq - own, *out.shape[1:])])
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


def gpt_model_of(model):
    """The GPTModel inside Megatron's wrappers (DDP, ``Float16Module``: their ``.module``)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def check_model(model) -> None:
    """Raise unless the (DDP-wrapped) Megatron GPT model was built with `get_gpt_layer_dcp_spec`
    (Megatron's own layers and attention would silently ignore the task) and uses positions DCP
    can follow (RoPE by Megatron's ``RotaryEmbedding``, learned absolute, or none)."""
    inner = gpt_model_of(model)
    modules = list(inner.modules())
    for kind in (DCPCoreAttention, DCPTransformerLayer):
        if not any(isinstance(m, kind) for m in modules):
            raise TypeError(f"the model has no {kind.__name__}: build it with "
                            "megatron_dcp.megatron.get_gpt_layer_dcp_spec()")
    rope = getattr(inner, "rotary_pos_emb", None)
    if rope is not None and not hasattr(rope, "get_emb"):
        raise TypeError(f"DCP supports RoPE via Megatron's RotaryEmbedding, got "
                        f"{type(rope).__name__}")
    kind = getattr(inner, "position_embedding_type", "rope")
    if kind not in ("rope", "learned_absolute", "none"):
        raise TypeError(f"DCP does not follow position_embedding_type={kind!r} (rope, "
                        "learned_absolute and none are supported)")
