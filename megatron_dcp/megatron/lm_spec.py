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

from megatron_dcp.megatron.spec import get_gpt_layer_dcp_spec


def layer_spec_from_args(args):
    """`get_gpt_layer_dcp_spec` for Megatron-LM's parsed ``args``."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = args.transformer_impl == "transformer_engine" and bool(
        getattr(gpt_layer_specs, "HAVE_TE", False))
    return get_gpt_layer_dcp_spec(normalization=args.normalization,
                                  qk_layernorm=bool(args.qk_layernorm),
                                  use_transformer_engine=use_te,
                                  num_experts=args.num_experts,
                                  moe_grouped_gemm=bool(args.moe_grouped_gemm))


layer_spec = layer_spec_from_args(get_args())
