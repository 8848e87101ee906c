"""The planner's MoE `ModelShape` fields from Megatron's MoE flags (one rule for
examples/pretrain_megatron.py's ``model_shape`` and `megatron_dcp.megatron.lm.model_shape_from_args`).

Kept apart from `megatron_dcp.megatron.moe` so that building a shape needs no megatron-core import.
"""

from __future__ import annotations

from typing import Any, Optional


def _get(args: Any, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


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
    With the expert tensor-parallel size equal to TP (Megatron's default), Megatron's expert
    ranks (order tp-ep-dp-pp) put an EP group on EP consecutive data-parallel ranks of one TP
    rank and stage: contiguous ranks of the DCP world, as `megatron_dcp.plan.geometry` assumes
    (DP x EP, TP x EP). Any other ``--expert-tensor-parallel-size`` raises `DCPArgumentError`,
    as do EP not dividing ``--num-experts`` or (with ``world_size`` or ``args.world_size``)
    the data-parallel size."""
    from megatron_dcp.megatron.args import DCPArgumentError, dcp_world_size

    experts = _get(args, "num_experts", 0)
    if not experts:
        return {}
    tp = _get(args, "tensor_model_parallel_size", 1)
    etp = _get(args, "expert_tensor_parallel_size", tp)
    ep = _get(args, "expert_model_parallel_size", 1)
    if etp != tp:
        raise DCPArgumentError(
            f"--dcp plans experts with --expert-tensor-parallel-size equal to "
            f"--tensor-model-parallel-size ({tp}); got {etp}: its expert-parallel groups would "
            "leave the data-parallel group (the DCP world)")
    if experts % ep:
        raise DCPArgumentError(f"--expert-model-parallel-size {ep} does not divide "
                               f"--num-experts {experts}")
    world = world_size if world_size is not None else _get(args, "world_size")
    if world is not None and ep > 1:
        dp = dcp_world_size(args, world)
        if dp % ep:
            raise DCPArgumentError(
                f"--expert-model-parallel-size {ep} does not divide the data-parallel size {dp} "
                "(the DCP world: world / (tensor x pipeline x context parallel))")
    num_layers = args.num_layers
    freq = _get(args, "moe_layer_freq", 1)
    return dict(num_experts=experts, moe_topk=_get(args, "moe_router_topk", 2),
                moe_ffn_hidden_size=_get(args, "moe_ffn_hidden_size", 0)
                or _get(args, "ffn_hidden_size", 0) or 4 * args.hidden_size,
                moe_shared_expert_ffn=_get(args, "moe_shared_expert_intermediate_size", 0),
                moe_dense_layers=_dense_layers(freq, num_layers), expert_parallel=ep)
