"""Megatron-LM argument flags for DCP and their validation against Megatron's own arguments.

``add_dcp_args`` is a Megatron-LM ``extra_args_provider``::

    from megatron.training import pretrain
    pretrain(..., extra_args_provider=add_dcp_args)

The flags (``--dcp``, ``--dcp-policy``, ``--dcp-max-degree`` ...) are generated from the one
`megatron_dcp.config.DCPConfig`; see docs/MEGATRON.md for how they relate to Megatron-LM's
``--hybrid-context-parallel`` / ``--dynamic-context-parallel`` and ``--max-seqlen-per-dp-cp-rank``.
``validate_dcp_args(args)`` turns the parsed flags into a `DCPConfig` and rejects combinations
that cannot work, at start, with a message naming the flags.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megatron_dcp.config import DCPConfig, DCPConfigError
from megatron_dcp.config import arg_value as _get


class DCPArgumentError(DCPConfigError):
    """A combination of Megatron and DCP flags that cannot work together."""


def add_dcp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--dcp`` and its knobs (Megatron's dashed style) to ``parser``; returns ``parser``."""
    return DCPConfig.add_arguments(parser, style="megatron")


def dcp_world_size(args: argparse.Namespace, world_size: Optional[int] = None) -> int:
    """Ranks of one DCP world: Megatron's data-parallel size (world / (tp x pp x cp))."""
    world = world_size if world_size is not None else _get(args, "world_size")
    if world is None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
    model_parallel = (_get(args, "tensor_model_parallel_size", 1)
                      * _get(args, "pipeline_model_parallel_size", 1)
                      * _get(args, "context_parallel_size", 1))
    if world % model_parallel:
        raise DCPArgumentError(f"world size {world} is not divisible by tensor x pipeline x "
                               f"context parallel size {model_parallel}")
    return world // model_parallel


def validate_dcp_args(args: argparse.Namespace, world_size: Optional[int] = None) -> DCPConfig:
    """Check DCP flags against Megatron's and return the `DCPConfig` (``enabled`` = ``--dcp``).

    Raises `DCPArgumentError` naming the offending flags. Without ``--dcp`` only a misuse of the
    ``--dcp-*`` knobs is an error (they would be silently ignored otherwise).
    """
    # Megatron's own schedule runs the plain data-parallel baseline: no --dcp-* knob applies.
    try:
        config = DCPConfig.from_args(args, style="megatron")
    except DCPConfigError as err:
        raise DCPArgumentError(str(err)) from None
    if not config.enabled:
        return config

    problems = []
    if _get(args, "context_parallel_size", 1) > 1:
        problems.append("--dcp replaces Megatron's static context parallelism: use "
                        "--context-parallel-size 1; DCP regroups the data-parallel ranks per "
                        "sequence (cap the degree with --dcp-max-degree)")
    for flag in ("hybrid_context_parallel", "dynamic_context_parallel"):
        if _get(args, flag, False):
            problems.append(f"--dcp and --{flag.replace('_', '-')} both schedule variable-length "
                            "context parallelism: choose one")
    if not _get(args, "calculate_per_token_loss", False):
        problems.append("--dcp needs --calculate-per-token-loss: Megatron's DDP must SUM gradients "
                        "over data-parallel ranks; DCP scales every loss by 1/T of the global "
                        "batch")
    problems += _dropout_problems(args)
    problems += _recompute_and_head_problems(args, config)
    problems += fixed_shape_problems(args)
    long = long_sequence_problems(args, config)
    if config.long_sequences == "on":
        problems += long
    elif long:  # auto: off where the engine cannot run a long task
        config = config.replace(long_sequences="off")
    from megatron_dcp.megatron.moe import moe_problems, moe_schedule

    problems += moe_problems(args)  # token dropping, micro-batch-level auxiliary losses
    try:
        config = moe_schedule(args, config)  # expert parallelism: lockstep slots
    except DCPConfigError as err:
        problems.append(str(err))
    if problems:
        raise DCPArgumentError("invalid DCP arguments:\n  - " + "\n  - ".join(problems))

    # Megatron's per-rank token cap maps to DCP's pack budget unless that is given explicitly.
    max_per_rank = _get(args, "max_seqlen_per_dp_cp_rank", None)
    if max_per_rank and config.pack_tokens is None:
        config = config.replace(pack_tokens=int(max_per_rank))
    dcp_world = dcp_world_size(args, world_size)  # its own error names the sizes
    try:
        config.check_world(dcp_world)
    except DCPConfigError as err:
        raise DCPArgumentError(f"{err} (the data-parallel size)") from None
    return config

def _dropout_problems(args: argparse.Namespace) -> list[str]:
    """Attention and hidden dropout (Megatron-LM's defaults: 0.1): refused above 0."""
    problems = []
    if (_get(args, "attention_dropout", 0.0) or 0.0) > 0:
        problems.append(f"--dcp needs --attention-dropout 0 (given "
                        f"{_get(args, 'attention_dropout')}; Megatron-LM's default is 0.1): "
                        "DCP splits a sequence's attention over ranks per the plan, so a random "
                        "dropout stream there would depend on the plan")
    if (_get(args, "hidden_dropout", 0.0) or 0.0) > 0:
        problems.append(f"--dcp needs --hidden-dropout 0 (given {_get(args, 'hidden_dropout')}; "
                        "Megatron-LM's default is 0.1): a token's dropout mask would come from "
                        "a random stream that depends on which rank runs it and in which "
                        "micro-step, so the update would depend on the plan")
    return problems


_VARIABLE_SHAPES = ("DCP's shards change their token count every micro-step (a task's tokens "
                    "over its ranks, padded to the tensor-parallel size only)")
FIXED_SHAPE_FEATURES = (
    ("fp8", "--fp8-format", "FP8 GEMMs need token counts that are multiples of 16 and FP8 "
     "recompute needs Transformer Engine's own checkpoint; " + _VARIABLE_SHAPES),
    ("fp4", "--fp4-format", "FP4 GEMMs need token counts that are multiples of 32; "
     + _VARIABLE_SHAPES),
    ("tp_comm_overlap", "--tp-comm-overlap", "its userbuffers are sized to --seq-length x "
     "--micro-batch-size at start; " + _VARIABLE_SHAPES),
    ("enable_cuda_graph", "--enable-cuda-graph", "a CUDA graph replays the shapes it captured; "
     + _VARIABLE_SHAPES),
    ("external_cuda_graph", "--external-cuda-graph", "a CUDA graph replays the shapes it "
     "captured; " + _VARIABLE_SHAPES),
)
"""Megatron features that need the same shapes every micro-step: ``(argument, flag, why)``."""


def fixed_shape_problems(args: Any, config_fields: bool = False) -> list[str]:
    """FP8/FP4, TP communication overlap and CUDA graphs, refused by name: each would crash (or
    replay wrong shapes) at the first micro-step of a GPU run, and none runs on a CPU to show
    it. ``args``: Megatron-LM's parsed flags, or with ``config_fields`` a model's
    ``TransformerConfig`` (the same names; a megatron-core user who sets them on the config
    never passes a flag), each problem then naming the field."""
    def named(name: str, flag: str, value: Any) -> str:
        return f"TransformerConfig.{name}={value!r}" if config_fields else flag

    who = "DCP" if config_fields else "--dcp"
    problems = [f"{who} does not support {named(name, flag, _get(args, name))}: {why}"
                for name, flag, why in FIXED_SHAPE_FEATURES
                if _get(args, name, None) not in (None, False, "", "none")]
    impl = _get(args, "cuda_graph_impl", "none")
    if impl not in (None, "none"):
        where = named("cuda_graph_impl", "--cuda-graph-impl", impl)
        problems.append(f"{who} does not support {where}{'' if config_fields else ' ' + impl}: "
                        f"a CUDA graph replays the shapes it captured; {_VARIABLE_SHAPES}")
    return problems


def _recompute_and_head_problems(args: argparse.Namespace, config: DCPConfig) -> list[str]:
    """Megatron recompute flags DCP cannot drive per task, and Ulysses degrees heads refuse."""
    problems = []
    granularity = _get(args, "recompute_granularity", None)
    if granularity == "selective" and config.recompute != "none":
        problems.append("--recompute-granularity selective is fixed when the model is built; DCP "
                        "sets the recomputed layers per task: use --recompute-granularity full "
                        "--recompute-method block, or --dcp-recompute none")
    if granularity == "full" and _get(args, "recompute_method", "block") != "block":
        problems.append("--dcp with --recompute-granularity full needs --recompute-method block "
                        "(DCP sets the number of recomputed layers per task)")
    tp = _get(args, "tensor_model_parallel_size", 1)
    heads = _get(args, "num_attention_heads", None)
    groups = _get(args, "num_query_groups", None) if _get(args, "group_query_attention", True) \
        else None
    if config.attention_layout == "ulysses" and heads is not None and config.max_degree:
        kv = groups or heads
        if (heads // tp) % config.max_degree or (kv // tp) % config.max_degree:
            problems.append(f"--dcp-attention-layout ulysses with --dcp-max-degree "
                            f"{config.max_degree}: heads per tensor-parallel rank ({heads // tp} "
                            f"query, {kv // tp} key/value) must be divisible by the degree")
    return problems


def long_sequence_problems(args: argparse.Namespace, config: DCPConfig) -> list[str]:
    """What ``--dcp-long-sequences`` cannot run with (each part by its flag): errors with
    ``on``, and what turns ``auto`` off; a long task's loss tiles
    (`megatron_dcp.megatron.loss_tiles`) cover the main loss, not multi-token prediction."""
    if config.long_sequences == "off":
        return []
    problems = []
    if _get(args, "pipeline_model_parallel_size", 1) > 1:
        problems.append("--dcp-long-sequences with --pipeline-model-parallel-size > 1 is not "
                        "supported: a pipeline stage holds several micro-batches in flight, "
                        "which the long-sequence choices do not count")
    if _get(args, "num_experts", None):
        problems.append("--dcp-long-sequences with --num-experts is not supported: the MLP "
                        "tiles of a long task run Megatron's dense MLP, not an MoE layer")
    if _get(args, "mtp_num_layers", None):
        problems.append("--dcp-long-sequences with --mtp-num-layers is not supported: a long "
                        "task's loss tiles run the main output layer and loss only")
    if _get(args, "distribute_saved_activations", False):
        problems.append("--dcp-long-sequences with --distribute-saved-activations is not "
                        "supported: an offloaded layer keeps its whole saved input in host "
                        "memory instead")
    return problems
