"""DCP's GPT layer spec for Megatron-LM's ``--spec``: ``--spec megatron_dcp.megatron.lm_spec
layer_spec``.

Megatron-LM reads ``--spec MODULE NAME`` as ``vars(import MODULE)[NAME]`` when it builds its
model config, after its arguments are parsed; this module builds ``layer_spec`` from those
arguments when it is imported (``--normalization``, ``--qk-layernorm``, ``--transformer-impl``,
``--num-experts``). Under ``--dcp`` the launcher sets it (`megatron_dcp.megatron.lm`); without
``--dcp`` it is a layer spec whose core attention takes Megatron-LM's THD packed sequences
(``--dataloader-inter-document-masking``) without Transformer Engine, as one rank.
"""

from megatron.training import get_args

from megatron_dcp.megatron.spec import get_gpt_block_dcp_spec, get_gpt_layer_dcp_spec


def layer_spec_from_args(args):
    """`get_gpt_layer_dcp_spec` for Megatron-LM's parsed ``args``; with ``--sequence-parallel``
    and no Transformer Engine, the block spec of `get_gpt_block_dcp_spec` (Megatron's final norm
    without TE, ``WrappedTorchNorm``, refuses sequence parallelism; `SPNorm` takes its place)."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = args.transformer_impl == "transformer_engine" and bool(
        getattr(gpt_layer_specs, "HAVE_TE", False))
    spec = get_gpt_layer_dcp_spec(normalization=args.normalization,
                                  qk_layernorm=bool(args.qk_layernorm),
                                  use_transformer_engine=use_te,
                                  num_experts=args.num_experts,
                                  moe_grouped_gemm=bool(args.moe_grouped_gemm))
    if not args.sequence_parallel or use_te:
        return spec
    if args.pipeline_model_parallel_size > 1:  # Megatron-LM imports --spec before its groups
        raise ValueError("--sequence-parallel with --pipeline-model-parallel-size > 1 and no "
                         "Transformer Engine: the final norm's stage is not known when "
                         "Megatron-LM reads --spec (use --transformer-impl transformer_engine)")
    from megatron.training.argument_utils import core_transformer_config_from_args

    return get_gpt_block_dcp_spec(core_transformer_config_from_args(args), spec, pp_rank=0)


layer_spec = layer_spec_from_args(get_args())
