"""The planner's `ModelShape` from Megatron's flags (`megatron_model_shape`, with its MoE fields
`moe_shape_fields`): one rule for examples/pretrain_megatron.py's ``model_shape`` and the
Megatron-LM launcher's `megatron_dcp.megatron.lm.model_shape_from_args`.

Kept apart from `megatron_dcp.megatron.moe` so that building a shape needs no megatron-core import.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional

from megatron_dcp.config import arg_value as _get
from megatron_dcp.plan.model import expert_dcp_ranks


def _dense_layers(freq: Any, num_layers: int) -> int:
    """Dense layers of Megatron's ``--moe-layer-freq`` (int N: layer i is MoE when i % N == 0;
    list: 1 MoE, 0 dense). Leading dense layers are exact; any other pattern is approximated
    by its count of dense layers (as if they led)."""
    from megatron_dcp.megatron.args import DCPArgumentError

    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        raise DCPArgumentError(f"--moe-layer-freq {freq!r}: expected an int or a list of 0/1")
    if isinstance(freq, int):
        if freq < 1:
            raise DCPArgumentError(f"--moe-layer-freq {freq}: must be >= 1")
        pattern = [1 if i % freq == 0 else 0 for i in range(num_layers)]
    else:
        pattern = [int(x) for x in freq]
        if len(pattern) != num_layers or set(pattern) - {0, 1}:
            raise DCPArgumentError(f"--moe-layer-freq: a list of {num_layers} (--num-layers) "
                                   "values 0 (dense) or 1 (MoE)")
    dense = pattern.count(0)
    if dense >= num_layers:
        raise DCPArgumentError("--moe-layer-freq makes every layer dense: drop --num-experts")
    return dense


def moe_shape_fields(args: Any, world_size: Optional[int] = None) -> dict:
    """`ModelShape` keywords of Megatron's MoE flags; ``{}`` for a dense model (``--num-experts``
    unset), so a dense shape is unchanged.

    num_experts ``--num-experts``; moe_topk ``--moe-router-topk``; moe_ffn_hidden_size
    ``--moe-ffn-hidden-size`` (default ``--ffn-hidden-size``, else 4 x hidden);
    moe_shared_expert_ffn ``--moe-shared-expert-intermediate-size`` (0: none);
    moe_dense_layers from ``--moe-layer-freq`` where present (`_dense_layers`: interleaved
    layouts are approximated by their dense count); expert_parallel
    ``--expert-model-parallel-size``.

    EP and the DCP world: the DCP world is Megatron's data-parallel group (CP is 1 under DCP).
    Megatron orders expert ranks expert-TP, EP, DP, PP and dense ranks TP, (CP), DP, PP, so an
    expert-parallel group is EP ranks of a block of ``EP x ETP`` consecutive ranks: with the
    expert tensor-parallel size ETP equal to TP (Megatron's default) EP consecutive DCP ranks of
    one TP rank; with ETP < TP (``--expert-tensor-parallel-size 1``: attention TP-sharded,
    experts whole) ``EP x ETP / TP`` DCP ranks, or inside one DCP rank's TP group when
    ``EP x ETP <= TP`` (`ModelShape.expert_dcp_ranks`). ETP must divide TP and ``EP x ETP``
    must divide TP or be a multiple of it; else, or where EP does not divide ``--num-experts``
    or the groups do not tile the data-parallel size (with ``world_size`` or
    ``args.world_size``), `DCPArgumentError`."""
    from megatron_dcp.megatron.args import DCPArgumentError, dcp_world_size

    experts = _get(args, "num_experts", 0)
    if not experts:
        return {}
    tp = _get(args, "tensor_model_parallel_size", 1)
    etp = _get(args, "expert_tensor_parallel_size", tp)
    ep = _get(args, "expert_model_parallel_size", 1)
    if tp % etp or (ep * etp % tp and tp % (ep * etp)):
        raise DCPArgumentError(
            f"--dcp plans experts with --expert-tensor-parallel-size dividing "
            f"--tensor-model-parallel-size ({tp}) and expert-parallel x expert-tensor-parallel "
            f"({ep} x {etp}) dividing it or a multiple of it: other layouts put an "
            "expert-parallel group on parts of several tensor-parallel groups")
    if experts % ep:
        raise DCPArgumentError(f"--expert-model-parallel-size {ep} does not divide "
                               f"--num-experts {experts}")
    span = expert_dcp_ranks(ep, etp, tp)
    world = world_size if world_size is not None else _get(args, "world_size")
    if world is not None and span > 1:
        dp = dcp_world_size(args, world)
        if dp % span:
            raise DCPArgumentError(
                f"an expert-parallel group spans {span} data-parallel ranks (EP {ep} x expert "
                f"TP {etp} / TP {tp}), which does not divide the data-parallel size {dp} (the "
                "DCP world: world / (tensor x pipeline x context parallel))")
    num_layers = args.num_layers
    freq = _get(args, "moe_layer_freq", 1)
    return dict(num_experts=experts, moe_topk=_get(args, "moe_router_topk", 2),
                moe_ffn_hidden_size=_get(args, "moe_ffn_hidden_size", 0)
                or _get(args, "ffn_hidden_size", 0) or 4 * args.hidden_size,
                moe_shared_expert_ffn=_get(args, "moe_shared_expert_intermediate_size", 0),
                moe_dense_layers=_dense_layers(freq, num_layers), expert_parallel=ep,
                **({"expert_tensor_parallel": etp} if etp != tp else {}))


def megatron_model_shape(args: Any, *, vocab_size: int, max_position: int, name: str):
    """The planner's `ModelShape` of the GPT model Megatron's flags ``args`` build (Megatron-LM's
    argument names). ``vocab_size``: the padded vocabulary (the embedding's rows);
    ``max_position``: the most positions one sequence of the front end's data path holds.
    KV heads: ``--num-query-groups`` where grouped-query attention is on (Megatron-LM ignores
    the groups without ``--group-query-attention``; a parser without that flag takes the groups
    as given); virtual pipeline stages: ``--virtual-pipeline-model-parallel-size`` (Megatron-LM
    sets it from ``--num-layers-per-virtual-pipeline-stage`` too)."""
    from megatron_dcp.plan.model import ModelShape

    groups = _get(args, "num_query_groups") if _get(args, "group_query_attention", True) \
        else None
    return ModelShape(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_heads=args.num_attention_heads,
                      ffn_hidden_size=_get(args, "ffn_hidden_size") or 4 * args.hidden_size,
                      vocab_size=vocab_size, num_kv_heads=groups or args.num_attention_heads,
                      max_position=max_position, name=name,
                      tensor_parallel=_get(args, "tensor_model_parallel_size", 1),
                      pipeline_parallel=_get(args, "pipeline_model_parallel_size", 1),
                      virtual_pipeline=_get(args, "virtual_pipeline_model_parallel_size", 1),
                      sequence_parallel=bool(_get(args, "sequence_parallel", False)),
                      **moe_shape_fields(args), **memory_rows(args))


def memory_rows(args: Any) -> dict:
    """``layer_memory`` and ``loss_memory`` (`megatron_dcp.plan.layer_memory`) of the model
    ``args`` build: Transformer Engine's layer where ``--transformer-impl transformer_engine``
    (the default; examples/pretrain_megatron.py detects) and TE is installed, else Megatron's
    local layer (as `megatron_dcp.megatron.lm_spec` builds it), with the fused SwiGLU where
    ``--bias-swiglu-fusion`` is on; TE's cross-entropy where ``--cross-entropy-loss-fusion``
    with ``--cross-entropy-fusion-impl te``, else Megatron's vocabulary-parallel one."""
    from megatron_dcp.plan.layer_memory import megatron_layer_row

    te = _get(args, "transformer_impl", "transformer_engine") == "transformer_engine" \
        and importlib.util.find_spec("transformer_engine") is not None  # Megatron's HAVE_TE
    layer = megatron_layer_row("transformer_engine" if te else "local",
                               bool(_get(args, "bias_swiglu_fusion", False)))
    te_loss = te and bool(_get(args, "cross_entropy_loss_fusion", False)) \
        and _get(args, "cross_entropy_fusion_impl", "native") == "te"
    return {"layer_memory": layer,
            "loss_memory": "te-parallel-cross-entropy" if te_loss else "megatron-vocab-parallel"}
