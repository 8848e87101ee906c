"""The Megatron internals megatron-dcp touches, by name: what a new version must still have.

Each entry is ``"module:Name.attr(param, ...)"``: a module, a name bound in it (a function, a
class, a constant, a re-export), optionally an attribute of that (a method, a class attribute, a
dataclass field, an enum member) and optionally parameters the call passes by keyword; ``"A |
B"`` is found when one of its alternatives is (code that takes either, by version). On a
megatron-core minor version that was not tested (`megatron_dcp.patching.SUPPORTED`), the version
policy looks every entry up at start-up (`missing`, by import; those of Megatron-LM's training
package, `LM_PACKAGE`, only where it is installed) and refuses the version naming what is
missing; ``tools/check_megatron_internals.py`` checks the same entries against a wheel's
sources without importing them. ``tests/test_megatron_internals.py`` walks the code's syntax
(imports, attributes of Megatron modules and classes, overridden methods, patch targets) and
fails on a name it uses that is not listed here. This module imports nothing of Megatron.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
from typing import Any

_CPU = "megatron_dcp/megatron/cpu/core.py"
_LM_CPU = "megatron_dcp/megatron/cpu/lm.py"
_SPEC = "megatron_dcp/megatron/spec.py"
_STEP = "megatron_dcp/megatron/step.py"
_MOE = "megatron_dcp/megatron/moe.py"
_ENGINE = "megatron_dcp/megatron/engine.py"
_PARALLEL = "megatron_dcp/megatron/parallel.py"
_PIPE = "megatron_dcp/megatron/pipeline_engine.py"
_OVERLAP = "megatron_dcp/megatron/overlap.py"
_BUCKETS = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup."
_LOSS_TILES = "megatron_dcp/megatron/loss_tiles.py"
_CKPT = "megatron_dcp/megatron/checkpointing.py"
_LM = "megatron_dcp/megatron/lm.py"
_LM_CKPT = "megatron_dcp/megatron/lm_checkpoint.py"
_LM_DATA = "megatron_dcp/megatron/lm_datasets.py"
_DRY = "megatron_dcp/dryrun/megatron_rank.py"
_DRY_MOE = "megatron_dcp/dryrun/moe_routing.py"
_PS = "megatron.core.parallel_state:"
_RANDOM = "megatron.core.tensor_parallel.random:"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher"
_ROUTER = "megatron.core.transformer.moe.router:TopKRouter"
_CONFIG = "megatron.core.transformer.transformer_config:TransformerConfig."
_BLOCK = "megatron.core.transformer.transformer_block:"
_DIST_CKPT = "megatron.core.dist_checkpointing"
LM_PACKAGE = "megatron.training"
"""Megatron-LM's training package: its entries are looked up only where it is installed."""
_ARGUMENTS = LM_PACKAGE + ".arguments:"
_TRAINING = LM_PACKAGE + ".training:"
_LM_CHECKPOINTING = LM_PACKAGE + ".checkpointing:"
_INITIALIZE = LM_PACKAGE + ".initialize:"

INTERNALS: dict[str, str] = {
    # CPU patch targets (replaced, aliases included) and what the CPU harness calls
    "megatron.core.transformer.utils:get_default_causal_mask": _CPU,
    "megatron.core.transformer.utils:get_sliding_window_causal_mask": _CPU,
    "megatron.core.fusions.fused_softmax:get_default_causal_mask": _CPU,
    "megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank": _CPU,
    "megatron.core.models.common.embeddings.rotary_pos_embedding:get_pos_emb_on_this_cp_rank":
        _CPU,
    _RANDOM + "_get_cuda_rng_state": _CPU,
    _RANDOM + "_set_cuda_rng_state": _CPU,
    _RANDOM + "_MODEL_PARALLEL_RNG_TRACKER_NAME": _LM_CPU,
    _RANDOM + "initialize_rng_tracker(inference_rng_tracker, force_reset)": _LM_CPU,
    "megatron.core.tensor_parallel:model_parallel_cuda_manual_seed"
    "(inference_rng_tracker, force_reset_rng)": _CPU,
    "megatron.core.optimizer:get_megatron_optimizer": _CPU,
    "megatron.core.pipeline_parallel.schedules:"
    "forward_backward_pipelining_without_interleaving": _CPU,
    "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving":
        _CPU,
    # the uneven gathers of the CPU collectives (MoE's dispatch over TP x EP on gloo)
    "megatron.core.tensor_parallel.mappings:_gather_along_first_dim": _CPU,
    "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim": _CPU,
    # layer spec: the classes spec.py subclasses, the spec slots and config fields it reads
    "megatron.core.packed_seq_params:PackedSeqParams.qkv_format": _SPEC,
    "megatron.core.packed_seq_params:PackedSeqParams.max_seqlen_q": _SPEC,
    "megatron.core.packed_seq_params:PackedSeqParams.max_seqlen_kv": _SPEC,
    "megatron.core.packed_seq_params:PackedSeqParams.cu_seqlens_q": _SPEC,
    "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_spec"
    "(normalization, qk_layernorm)": _SPEC,
    "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_with_transformer_engine_spec"
    "(qk_layernorm)": _SPEC,
    "megatron.core.models.gpt.gpt_layer_specs:HAVE_TE": "megatron_dcp/megatron/lm_spec.py",
    "megatron.core.transformer.transformer_layer:TransformerLayer.forward": _SPEC,
    "megatron.core.transformer.transformer_layer:TransformerLayer._forward_attention(hidden_states,"
    " attention_mask, context, context_mask, rotary_pos_emb, packed_seq_params)": _SPEC,
    "megatron.core.transformer.transformer_layer:TransformerLayerSubmodules.self_attention": _SPEC,
    "megatron.core.transformer.attention:SelfAttentionSubmodules.core_attention": _SPEC,
    "megatron.core.transformer.module:MegatronModule": _SPEC,
    "megatron.core.transformer.mlp:MLP": _SPEC,
    "megatron.core.transformer.torch_norm:WrappedTorchNorm": _SPEC,
    _BLOCK + "LayerNormImpl": _SPEC,
    _BLOCK + "TransformerBlockSubmodules": _SPEC,
    _BLOCK + "get_num_layers_to_build(vp_stage)": _SPEC,
    "megatron.core.transformer.moe.moe_layer:MoESubmodules.router": _MOE,
    # the router DCP subclasses: the methods it overrides and calls (private ones included)
    _ROUTER + ".routing": _MOE,
    _ROUTER + ".apply_z_loss": _MOE,
    _ROUTER + "._apply_seq_aux_loss": _MOE,
    _ROUTER + "._apply_aux_loss": _MOE,
    _ROUTER + "._apply_global_aux_loss": _MOE,
    _ROUTER + "._apply_expert_bias": _MOE,
    # the alltoall dispatcher's host copies (MoE CPU patch) and the dry run's balanced routing
    _DISPATCHER + "._maybe_dtoh_and_synchronize": _CPU,
    _DISPATCHER + ".cuda_dtoh_stream": _CPU,
    _DISPATCHER + ".preprocess": _DRY_MOE,
    "megatron.core.transformer.moe.token_dispatcher:permute": _DRY_MOE,
    "megatron.core.transformer.moe.token_dispatcher:unpermute": _DRY_MOE,
    "megatron.core.tensor_parallel:gather_from_sequence_parallel_region": _DRY_MOE,
    "megatron.core.transformer.enums:AttnMaskType.causal": _SPEC,
    "megatron.core.transformer.enums:AttnMaskType.padding_causal": _SPEC,
    "megatron.core.tensor_parallel:checkpoint": _SPEC,
    _CONFIG + "distribute_saved_activations": _SPEC,
    _CONFIG + "attention_dropout": _SPEC,
    _CONFIG + "kv_channels": _SPEC,
    _CONFIG + "deterministic_mode": _SPEC,
    _CONFIG + "recompute_granularity": _SPEC,
    _CONFIG + "calculate_per_token_loss": _STEP,
    # loss tiles: GPTModel's forward arguments read by a pre-hook, the output layer's forward
    # and the loss they run per tile (0.19's LanguageModule._scale_logits is used where present)
    "megatron.core.models.gpt.gpt_model:GPTModel.forward(labels, packed_seq_params)": _LOSS_TILES,
    "megatron.core.models.common.language_module.language_module:"
    "LanguageModule.compute_language_model_loss(labels, logits)": _LOSS_TILES,
    "megatron.core.tensor_parallel.layers:ColumnParallelLinear.forward(weight, "
    "runtime_gather_output)": _LOSS_TILES,
    _CONFIG + "mtp_num_layers": _LOSS_TILES,
    "megatron.core.model_parallel_config:ModelParallelConfig.sequence_parallel": _LOSS_TILES,
    # the step: model config, DDP's no_sync, one finalize_model_grads
    "megatron.core.utils:get_model_config": _STEP,
    "megatron.core.utils:unwrap_model": _LM_CKPT,
    "megatron.core.model_parallel_config:ModelParallelConfig.grad_scale_func": _ENGINE,
    "megatron.core.model_parallel_config:ModelParallelConfig.finalize_model_grads_func": _ENGINE,
    "megatron.core.distributed:finalize_model_grads(num_tokens)": _ENGINE,
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.no_sync": _ENGINE,
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.finish_grad_sync":
        _ENGINE,
    # the overlaps under DCP (overlap.py): DDP's bucket groups, started and waited for in
    # one order on every rank (bucket_groups, param_gather_handle ... are instance attributes)
    "megatron.core.distributed.distributed_data_parallel_config:"
    "DistributedDataParallelConfig.overlap_param_gather": _OVERLAP,
    "megatron.core.distributed.distributed_data_parallel_config:"
    "DistributedDataParallelConfig.overlap_grad_reduce": _OVERLAP,
    _BUCKETS + "start_grad_sync": _OVERLAP,
    _BUCKETS + "start_param_sync": _OVERLAP,
    _BUCKETS + "finish_param_sync(skip_next_bucket_dispatch)": _OVERLAP,
    # the job's parallel layout (MegatronParallel), built once, and the groups' teardown
    _PS + "get_data_parallel_group": _PARALLEL,
    _PS + "model_parallel_is_initialized": _PARALLEL,
    _PS + "get_tensor_model_parallel_world_size": _PARALLEL,
    _PS + "get_pipeline_model_parallel_group": _PARALLEL,
    _PS + "get_pipeline_model_parallel_world_size": _PARALLEL,
    _PS + "get_virtual_pipeline_model_parallel_world_size": _PARALLEL,
    _PS + "get_tensor_model_parallel_group(check_initialized)": _PARALLEL,
    _PS + "destroy_model_parallel": _PARALLEL,
    "megatron.core.process_groups_config:ProcessGroupCollection.use_mpu_process_groups":
        _PARALLEL,
    _PS + "get_pipeline_model_parallel_rank": _DRY,
    _PS + "is_pipeline_first_stage": _DRY,
    _PS + "is_pipeline_last_stage": _DRY,
    # pipeline parallelism: Megatron's schedules, their table and P2P shape exchange
    "megatron.core.pipeline_parallel:get_forward_backward_func": _PIPE,
    "megatron.core.pipeline_parallel.schedules:get_schedule_table": _PIPE,
    "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate_shapes":
        _PIPE,
    "megatron.core.pipeline_parallel.hybrid_cp_schedule:BalancedCPScheduler":
        "megatron_dcp/megatron/hybrid_cp_baseline.py",
    # checkpoints: torch_dist saves and loads, read safely
    _DIST_CKPT + ":save": _CKPT,
    _DIST_CKPT + ":load": _CKPT,
    _DIST_CKPT + ":ShardedTensor": _CKPT,
    _DIST_CKPT + ".dict_utils:nested_values": _CKPT,
    _DIST_CKPT + ".strategies.torch:_get_filesystem_reader": _CKPT,
    _DIST_CKPT + ".strategies.torch:TorchDistLoadShardedStrategy": _CKPT,
    # the common state: 0.16 reads common.pt through a common strategy, 0.19 through the reader
    # serialization imports
    _DIST_CKPT + ".strategies.common:TorchCommonLoadStrategy.load_common | "
    + _DIST_CKPT + ".serialization:_get_filesystem_reader": _CKPT,
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer": _CKPT,
    # the dry run's Megatron rank: model, DDP, its coalesced reduction, parallel state
    "megatron.core.models.gpt:GPTModel": _DRY,
    "megatron.core.transformer.module:Float16Module": _DRY,
    "megatron.core.distributed:DistributedDataParallel": _DRY,
    "megatron.core.distributed:DistributedDataParallelConfig": _DRY,
    "megatron.core.distributed.param_and_grad_buffer:_coalescing_manager": _DRY,
    _PS + "RankGenerator": _DRY,
    _PS + "initialize_model_parallel": _DRY,
    # Megatron-LM's training package (megatron-core 0.19's wheel): what the launcher hooks and
    # calls (looked up only where the package is installed: without it there is no launcher)
    _ARGUMENTS + "parse_args": _LM,
    _ARGUMENTS + "validate_args": _LM,
    _ARGUMENTS + "get_device_arch_version": _LM_CPU,
    _TRAINING + "get_forward_backward_func": _LM,
    _TRAINING + "train_step": _LM,
    _TRAINING + "save_checkpoint": _LM,
    _TRAINING + "load_checkpoint": _LM,
    _TRAINING + "pretrain": _LM_CPU,
    _LM_CHECKPOINTING + "load_args_from_checkpoint": _LM,
    _LM_CHECKPOINTING + "get_checkpoint_name(return_base_dir, release)": _LM_CKPT,
    _LM_CHECKPOINTING + "get_checkpoint_tracker_filename": _LM_CKPT,
    _LM_CHECKPOINTING + "checkpoint_exists": _LM_CKPT,
    _LM_CHECKPOINTING + "_NON_PERSISTENT_CKPT_SUBDIR": _LM_CKPT,
    _LM_CHECKPOINTING + "get_rng_state": _LM_CPU,
    _INITIALIZE + "initialize_megatron(allow_no_cuda)": _LM_CPU,
    _INITIALIZE + "_compile_dependencies": _LM_CPU,
    "megatron.core.datasets.utils:compile_helpers": _LM_CPU,
    _INITIALIZE + "set_jit_fusion_options": _LM_CPU,
    _INITIALIZE + "_set_random_seed(inference_rng_tracker)": _LM_CPU,
    _INITIALIZE + "_initialize_distributed": _LM_CPU,
    "megatron.training:get_args": _LM,
    "megatron.training.global_vars:set_global_variables": _LM_DATA,
    "megatron.training.utils:get_blend_and_blend_per_split": _LM_DATA,
    "megatron.training:get_tokenizer": _LM_CKPT,
    "megatron.training.global_vars:get_tensorboard_writer": "megatron_dcp/megatron/lm_monitor.py",
    "megatron.training.global_vars:get_wandb_writer": "megatron_dcp/megatron/lm_monitor.py",
    "megatron.training.argument_utils:core_transformer_config_from_args":
        "megatron_dcp/megatron/lm_spec.py",
}
"""Every internal, by name, with the megatron-dcp file that uses it. An entry ``"A | B"`` is
found when one of its alternatives is (code that takes either, by version)."""

ADDED: dict[str, str] = {
    "megatron.core.transformer.moe.moe_utils:te_general_gemm": _CPU,
}
"""Names the code sets where the installed Megatron leaves them unset (not looked up)."""


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


def alternatives(entry: str) -> list[str]:
    """The alternatives of an entry (``"A | B"``), each ``module:Name.attr(params)``."""
    return [part.strip() for part in entry.split("|")]


def _lookup(entry: str) -> str | None:
    """Why no alternative of ``entry`` is found in the imported package, or None when one is."""
    reasons = [_lookup_one(part) for part in alternatives(entry)]
    return None if None in reasons else " and ".join(reasons)  # type: ignore[arg-type]


def _lookup_one(entry: str) -> str | None:
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


def applicable(entries, has_lm: bool) -> list[str]:
    """The entries to look up: without Megatron-LM's training package (``has_lm`` False) those
    of `LM_PACKAGE` are left out (the launcher, their only user, cannot run there)."""
    return [e for e in entries if has_lm or not all(
        parse(part)[0].startswith(LM_PACKAGE) for part in alternatives(e))]


def missing(entries=None) -> list[str]:
    """The internals (default: all of `INTERNALS`) the installed megatron-core lacks, each as
    ``"<why> (used by <file>)"``; empty when every one is found. Imports Megatron."""
    table = INTERNALS if entries is None else entries
    has_lm = importlib.util.find_spec(LM_PACKAGE) is not None
    found = []
    for entry in applicable(table, has_lm):
        why = _lookup(entry)
        if why is not None:
            found.append(f"{why} (used by {table[entry]})" if isinstance(table, dict) else why)
    return found
