"""The megatron-core internals megatron-dcp touches, by name: what a new version must still have.

Each entry is ``"module:Name.attr(param, ...)"``: a module, a name bound in it (a function, a
class, a constant, a re-export), optionally an attribute of that (a method, a class attribute, a
dataclass field, an enum member) and optionally parameters the call passes by keyword. On a
megatron-core minor version that was not tested (`megatron_dcp.patching.SUPPORTED`), the version
policy looks every entry up at start-up (`missing`, by import) and refuses the version naming
what is missing; ``tools/check_megatron_internals.py`` checks the same entries against a wheel's
sources without importing them. This module imports nothing of Megatron.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import Any

_CPU = "megatron_dcp/megatron/cpu.py"
_SPEC = "megatron_dcp/megatron/spec.py"
_STEP = "megatron_dcp/megatron/step.py"
_MOE = "megatron_dcp/megatron/moe.py"
_ENGINE = "megatron_dcp/megatron/engine.py"
_LOSS_TILES = "megatron_dcp/megatron/loss_tiles.py"
_DRY_MOE = "megatron_dcp/dryrun/moe_routing.py"

INTERNALS: dict[str, str] = {
    # CPU patch targets (replaced, aliases included) and what cpu.py calls
    "megatron.core.transformer.utils:get_default_causal_mask": _CPU,
    "megatron.core.transformer.utils:get_sliding_window_causal_mask": _CPU,
    "megatron.core.fusions.fused_softmax:get_default_causal_mask": _CPU,
    "megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank": _CPU,
    "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb": _CPU,
    "megatron.core.transformer.dot_product_attention:DotProductAttention": _CPU,
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state": _CPU,
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": _CPU,
    "megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed"
    "(inference_rng_tracker, force_reset_rng)": _CPU,
    "megatron.core.optimizer:get_megatron_optimizer": _CPU,
    # layer spec: the classes spec.py subclasses, the spec slots and config fields it reads
    "megatron.core.packed_seq_params:PackedSeqParams.qkv_format": _SPEC,
    "megatron.core.packed_seq_params:PackedSeqParams.max_seqlen_q": _SPEC,
    "megatron.core.packed_seq_params:PackedSeqParams.max_seqlen_kv": _SPEC,
    "megatron.core.packed_seq_params:PackedSeqParams.cu_seqlens_q": _SPEC,
    "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_spec"
    "(normalization, qk_layernorm)": _SPEC,
    "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_with_transformer_engine_spec"
    "(qk_layernorm)": _SPEC,
    "megatron.core.transformer.transformer_layer:TransformerLayer.forward": _SPEC,
    "megatron.core.transformer.transformer_layer:TransformerLayer._forward_attention(hidden_states,"
    " attention_mask, context, context_mask, rotary_pos_emb, packed_seq_params)": _SPEC,
    "megatron.core.transformer.transformer_layer:TransformerLayerSubmodules.self_attention": _SPEC,
    "megatron.core.transformer.attention:SelfAttentionSubmodules.core_attention": _SPEC,
    "megatron.core.transformer.module:MegatronModule": _SPEC,
    "megatron.core.transformer.moe.moe_layer:MoESubmodules.router": _MOE,
    # the alltoall dispatcher's host copies (MoE CPU patch) and the dry run's balanced routing
    "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher"
    "._maybe_dtoh_and_synchronize": _MOE,
    "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher.cuda_dtoh_stream":
        _MOE,
    "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher.preprocess":
        _DRY_MOE,
    "megatron.core.transformer.moe.token_dispatcher:permute": _DRY_MOE,
    "megatron.core.transformer.moe.token_dispatcher:unpermute": _DRY_MOE,
    "megatron.core.transformer.enums:AttnMaskType.causal": _SPEC,
    "megatron.core.transformer.enums:AttnMaskType.padding_causal": _SPEC,
    "megatron.core.tensor_parallel.random:checkpoint": _SPEC,
    "megatron.core.transformer.transformer_config:TransformerConfig.distribute_saved_activations":
        _SPEC,
    "megatron.core.transformer.transformer_config:TransformerConfig.attention_dropout": _SPEC,
    "megatron.core.transformer.transformer_config:TransformerConfig.kv_channels": _SPEC,
    "megatron.core.transformer.transformer_config:TransformerConfig.deterministic_mode": _SPEC,
    "megatron.core.transformer.transformer_config:TransformerConfig.recompute_granularity": _SPEC,
    "megatron.core.transformer.transformer_config:TransformerConfig.calculate_per_token_loss":
        _STEP,
    # loss tiles: GPTModel's forward arguments read by a pre-hook, the output layer's forward
    # and the loss they run per tile (0.19's LanguageModule._scale_logits is used where present)
    "megatron.core.models.gpt.gpt_model:GPTModel.forward(labels, packed_seq_params)": _LOSS_TILES,
    "megatron.core.models.common.language_module.language_module:"
    "LanguageModule.compute_language_model_loss(labels, logits)": _LOSS_TILES,
    "megatron.core.tensor_parallel.layers:ColumnParallelLinear.forward(weight, "
    "runtime_gather_output)": _LOSS_TILES,
    "megatron.core.transformer.transformer_config:TransformerConfig.mtp_num_layers": _LOSS_TILES,
    "megatron.core.model_parallel_config:ModelParallelConfig.sequence_parallel": _LOSS_TILES,
    # the step: model config, DDP's no_sync, one finalize_model_grads
    "megatron.core.utils:get_model_config": _STEP,
    "megatron.core.model_parallel_config:ModelParallelConfig.grad_scale_func": _ENGINE,
    "megatron.core.model_parallel_config:ModelParallelConfig.finalize_model_grads_func": _ENGINE,
    "megatron.core.distributed:finalize_model_grads(num_tokens)": _ENGINE,
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.no_sync": _ENGINE,
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.finish_grad_sync":
        _ENGINE,
    "megatron.core.distributed.distributed_data_parallel_config:"
    "DistributedDataParallelConfig.overlap_param_gather": _STEP,
    "megatron.core.parallel_state:get_data_parallel_group": _ENGINE,
    "megatron.core.parallel_state:model_parallel_is_initialized": _ENGINE,
    "megatron.core.parallel_state:get_tensor_model_parallel_world_size": _ENGINE,
    "megatron.core.parallel_state:destroy_model_parallel": "megatron_dcp/megatron/parallel.py",
}
"""Every internal, by name, with the megatron-dcp file that uses it."""


def module_submodules(entry: Any) -> Any:
    """The ``submodules`` of one entry of a layer spec: a ``ModuleSpec``'s ``.submodules``
    (megatron-core 0.16), or the ``submodules=`` keyword of the ``functools.partial(module,
    submodules=...)`` that 0.19's spec builders return for an MLP or MoE layer."""
    if isinstance(entry, functools.partial):
        return entry.keywords["submodules"]
    return entry.submodules


_ENTRY = re.compile(r"^([\w.]+):([\w.]+)(?:\(([\w, ]*)\))?$")


def parse(entry: str) -> tuple[str, list[str], list[str]]:
    """``"module:A.b(p, q)"`` -> (module, [A, b], [p, q])."""
    match = _ENTRY.match(entry)
    if match is None:
        raise ValueError(f"malformed internal {entry!r}")
    module, path, params = match.groups()
    return module, path.split("."), [p.strip() for p in (params or "").split(",") if p.strip()]


def _lookup(entry: str) -> str | None:
    """Why ``entry`` is not found in the imported package, or None when it is."""
    module_name, path, params = parse(entry)
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # an import that fails is a missing internal, named
        return f"module {module_name} does not import ({type(err).__name__}: {err})"
    for i, name in enumerate(path):
        fields = getattr(obj, "__dataclass_fields__", {}) if inspect.isclass(obj) else {}
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif name in fields and i == len(path) - 1:
            obj = fields[name]  # a dataclass field without a default
        else:
            return f"{module_name}.{'.'.join(path[:i + 1])} does not exist"
    if params:
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):
            return f"{module_name}.{'.'.join(path)} has no signature"
        absent = [p for p in params if p not in signature.parameters]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        if absent and not takes_any:
            return f"{module_name}.{'.'.join(path)} has no parameter {', '.join(absent)}"
    return None


def missing(entries=None) -> list[str]:
    """The internals (default: all of `INTERNALS`) the installed megatron-core lacks, each as
    ``"<why> (used by <file>)"``; empty when every one is found. Imports Megatron."""
    table = INTERNALS if entries is None else entries
    found = []
    for entry in table:
        why = _lookup(entry)
        if why is not None:
            found.append(f"{why} (used by {table[entry]})" if isinstance(table, dict) else why)
    return found

