"""Megatron flags for DCP: generation from DCPConfig, validation against Megatron's arguments;
the patches (one registry) being reversible and refusing an unchecked megatron-core version."""

import argparse

import pytest

from megatron_dcp.config import DCPConfig
from megatron_dcp.megatron.args import DCPArgumentError, add_dcp_args, validate_dcp_args


def megatron_like_parser() -> argparse.ArgumentParser:
    """The Megatron-LM flags validate_dcp_args looks at, with Megatron's defaults."""
    p = argparse.ArgumentParser()
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--hybrid-context-parallel", action="store_true")
    p.add_argument("--calculate-per-token-loss", action="store_true")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute-granularity", default=None)
    p.add_argument("--recompute-method", default=None)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--max-seqlen-per-dp-cp-rank", type=int, default=None)
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--hidden-dropout", type=float, default=0.0)  # the tests' models: off
    p.add_argument("--fp8-format", dest="fp8", default=None)
    p.add_argument("--fp4-format", dest="fp4", default=None)
    p.add_argument("--tp-comm-overlap", action="store_true")
    p.add_argument("--enable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-impl", default="none")
    return add_dcp_args(p)


def parse(line: str) -> argparse.Namespace:
    return megatron_like_parser().parse_args(line.split())


def test_flags_are_generated_from_dcp_config():
    args = parse("--dcp --dcp-policy dcp-inter --dcp-max-degree 4 --calculate-per-token-loss")
    config = validate_dcp_args(args, world_size=8)
    assert config == DCPConfig(enabled=True, policy="dcp-inter", max_degree=4)
    # every DCPConfig field has a dashed flag
    help_text = megatron_like_parser().format_help()
    for name in DCPConfig.__dataclass_fields__:
        if name != "enabled":
            assert "--dcp-" + name.replace("_", "-") in help_text


def test_disabled_is_fine_but_knobs_without_dcp_fail():
    assert validate_dcp_args(parse(""), world_size=2).enabled is False
    with pytest.raises(DCPArgumentError, match="--dcp-max-degree given without --dcp"):
        validate_dcp_args(parse("--dcp-max-degree 2"), world_size=2)


@pytest.mark.parametrize("line, message", [
    ("--dcp", "--calculate-per-token-loss"),
    ("--dcp --calculate-per-token-loss --context-parallel-size 2", "--context-parallel-size 1"),
    ("--dcp --calculate-per-token-loss --hybrid-context-parallel", "--hybrid-context-parallel"),
    ("--dcp --calculate-per-token-loss --recompute-granularity selective", "selective"),
    ("--dcp --calculate-per-token-loss --dcp-max-degree 8", "exceeds the DCP world size 4"),
    ("--dcp --calculate-per-token-loss --tensor-model-parallel-size 2 --dcp-attention-layout "
     "ulysses --dcp-max-degree 4 --num-attention-heads 4", "divisible by the degree"),
    # issue 46: each would crash (or replay wrong shapes) at the first GPU micro-step
    ("--dcp --calculate-per-token-loss --fp8-format hybrid", "--fp8-format: FP8 GEMMs need"),
    ("--dcp --calculate-per-token-loss --fp4-format e2m1", "--fp4-format"),
    ("--dcp --calculate-per-token-loss --tp-comm-overlap", "--tp-comm-overlap: its userbuffers"),
    ("--dcp --calculate-per-token-loss --enable-cuda-graph", "--enable-cuda-graph: a CUDA graph"),
    ("--dcp --calculate-per-token-loss --cuda-graph-impl local", "--cuda-graph-impl local"),
    # issue 48: hidden dropout as attention dropout
    ("--dcp --calculate-per-token-loss --hidden-dropout 0.1", "--hidden-dropout 0 .given 0.1"),
])
def test_bad_combinations_fail_with_a_clear_message(line, message):
    with pytest.raises(DCPArgumentError, match=message):
        validate_dcp_args(parse(line), world_size=4 if "tensor" not in line else 8)


def test_pipeline_parallel_is_accepted():
    """1F1B pipelines run the plan's lockstep slots (the DCP world: data-parallel ranks)."""
    args = parse("--dcp --calculate-per-token-loss --pipeline-model-parallel-size 2")
    assert validate_dcp_args(args, world_size=4).enabled


def test_sequence_parallel_is_accepted():
    """SP with TP 2: the step pads every shard to a multiple of TP (tests/test_megatron_sp.py)."""
    args = parse("--dcp --calculate-per-token-loss --tensor-model-parallel-size 2 "
                 "--sequence-parallel")
    assert validate_dcp_args(args, world_size=8).enabled


def test_overlap_grad_reduce_is_accepted():
    args = parse("--dcp --calculate-per-token-loss --overlap-grad-reduce")
    assert validate_dcp_args(args, world_size=2).enabled


def test_max_seqlen_per_dp_cp_rank_becomes_the_pack_budget():
    args = parse("--dcp --calculate-per-token-loss --max-seqlen-per-dp-cp-rank 4096")
    assert validate_dcp_args(args, world_size=2).pack_tokens == 4096
    args = parse("--dcp --calculate-per-token-loss --max-seqlen-per-dp-cp-rank 4096 "
                 "--dcp-pack-tokens 100")
    assert validate_dcp_args(args, world_size=2).pack_tokens == 100


def test_cpu_patches_are_reversible():
    import torch
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    from megatron_dcp.megatron.cpu.core import cpu_enabled, cpu_patches

    if torch.cuda.is_available():
        pytest.skip("CPU patches are refused on a GPU machine")
    original_mask, original_device = utils.get_default_causal_mask, torch.cuda.current_device
    with cpu_patches():
        assert cpu_enabled()
        assert fused_softmax.get_default_causal_mask(3).tolist() == [
            [False, True, True], [False, False, True], [False, False, False]]
        assert torch.cuda.current_device() == "cpu"
    assert not cpu_enabled()
    assert utils.get_default_causal_mask is original_mask
    assert fused_softmax.get_default_causal_mask is original_mask
    assert torch.cuda.current_device is original_device


def test_patches_refuse_an_unchecked_megatron_version(monkeypatch):
    import torch
    from megatron.core.transformer import utils

    from megatron_dcp import patching
    from megatron_dcp.megatron.cpu import core as cpu

    if torch.cuda.is_available():
        pytest.skip("CPU patches are refused on a GPU machine")
    cpu.disable_cpu()
    original = utils.get_default_causal_mask
    from megatron_dcp.megatron import internals

    monkeypatch.setattr(patching, "package_version", lambda package: (0, 99, 0))
    monkeypatch.setattr(patching, "_CHECKED", {})
    monkeypatch.setattr(internals, "INTERNALS", {"megatron.core.transformer.utils:gone": "x"})
    with pytest.raises(patching.PatchVersionError,
                       match="megatron-core 0.99.0 is not(.|\n)*utils.gone does not exist"):
        cpu.enable_cpu()
    assert not cpu.cpu_enabled() and utils.get_default_causal_mask is original


def test_a_patch_that_fails_half_way_is_undone_and_not_registered():
    import types

    from megatron_dcp import patching

    holder = types.SimpleNamespace(a=1)

    def install(patches):
        patches.set(holder, "a", 2)
        patches.set(holder, "b", 3)  # an attribute the object did not have
        raise patching.PatchVersionError("internals moved")

    with pytest.raises(patching.PatchVersionError, match="internals moved"):
        patching.apply("test-half-way", "megatron-core", install)
    assert vars(holder) == {"a": 1} and not patching.is_applied("test-half-way")


# Megatron-LM's attribute names and defaults as its parser sets them, read from megatron-core
# 0.19.2's megatron/training/arguments.py (flags of the config dataclasses come from its
# ArgumentGroupFactory: ModelParallelConfig, TransformerConfig, DistributedDataParallelConfig,
# TrainingConfig); virtual_pipeline_model_parallel_size is set later by its validate_args.
MEGATRON_LM_0_19_DEFAULTS = dict(
    world_size=8, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
    num_virtual_stages_per_pipeline_rank=None, sequence_parallel=False, context_parallel_size=1,
    hybrid_context_parallel=False, max_seqlen_per_dp_cp_rank=None,
    calculate_per_token_loss=False, recompute_granularity=None, recompute_method=None,
    num_attention_heads=None, num_query_groups=None, group_query_attention=False,
    overlap_grad_reduce=False, overlap_param_gather=False, use_distributed_optimizer=False,
    ckpt_format="torch_dist")


def megatron_lm_args(line: str = "", **megatron) -> argparse.Namespace:
    """Megatron-LM's namespace (0.19.2 names/defaults) plus add_dcp_args' flags parsed from
    ``line``, as pretrain(extra_args_provider=add_dcp_args) produces it."""
    dcp = add_dcp_args(argparse.ArgumentParser()).parse_args(line.split())
    return argparse.Namespace(**{**MEGATRON_LM_0_19_DEFAULTS, **vars(dcp), **megatron})


def test_megatron_lm_namespace_defaults_with_dcp():
    with pytest.raises(DCPArgumentError, match="--calculate-per-token-loss"):
        validate_dcp_args(megatron_lm_args("--dcp"))
    config = validate_dcp_args(megatron_lm_args("--dcp", calculate_per_token_loss=True,
                                                overlap_grad_reduce=True,
                                                use_distributed_optimizer=True))
    assert config.enabled
    assert not validate_dcp_args(megatron_lm_args(overlap_param_gather=True)).enabled


@pytest.mark.parametrize("megatron, message", [
    (dict(context_parallel_size=2), "--context-parallel-size 1"),
    (dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
    (dict(recompute_granularity="selective"), "selective"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-method block"),
    (dict(attention_dropout=0.1), "--attention-dropout 0"),  # Megatron-LM's default
])
def test_megatron_lm_namespace_refusals(megatron, message):
    args = megatron_lm_args("--dcp", calculate_per_token_loss=True, **megatron)
    with pytest.raises(DCPArgumentError, match=message):
        validate_dcp_args(args)


def test_megatron_lm_namespace_acceptances():
    base = dict(calculate_per_token_loss=True)
    for megatron in (dict(ckpt_format="torch"), dict(ckpt_format="torch_dist"),
                     dict(recompute_granularity="full", recompute_method="block"),
                     dict(num_attention_heads=8, num_query_groups=2, group_query_attention=True,
                          tensor_model_parallel_size=2),
                     dict(max_seqlen_per_dp_cp_rank=4096),
                     # issue 56: both overlaps (tests/test_megatron_overlap.py)
                     dict(overlap_param_gather=True, overlap_grad_reduce=True,
                          use_distributed_optimizer=True),
                     dict(sequence_parallel=True, tensor_model_parallel_size=2,
                          pipeline_model_parallel_size=2),
                     # interleaved pipelines (Megatron-LM sets the size from either flag)
                     dict(num_layers_per_virtual_pipeline_stage=2, pipeline_model_parallel_size=2),
                     dict(virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_size=2)):
        config = validate_dcp_args(megatron_lm_args("--dcp", **base, **megatron))
        assert config.enabled
    assert validate_dcp_args(megatron_lm_args(
        "--dcp", **base, max_seqlen_per_dp_cp_rank=4096)).pack_tokens == 4096


def test_megatron_lm_dump_shows_the_values_in_effect():
    """Issue 45, item 3: with ``--dcp`` every DCP flag not given reads as the value DCP uses in
    Megatron-LM's argument dump (``dcp_policy dcp``, not ``None``); given values stay, and the
    config validated from the filled namespace is the one from the given flags."""
    from megatron_dcp.megatron.lm import show_values_in_effect

    args = megatron_lm_args("--dcp --dcp-max-degree 4", calculate_per_token_loss=True)
    before = validate_dcp_args(args)
    show_values_in_effect(args)
    assert (args.dcp_policy, args.dcp_recompute, args.dcp_max_degree) == ("dcp", "auto", 4)
    assert args.dcp_pack_tokens is None  # "auto": its default is no value
    assert validate_dcp_args(args) == before


@pytest.mark.parametrize("field, value", [("fp8", "hybrid"), ("fp4", "nvfp4"),
                                          ("tp_comm_overlap", True),
                                          ("enable_cuda_graph", True)])
def test_a_fixed_shape_feature_set_on_the_model_config_is_refused_naming_the_field(field,
                                                                                   value):
    """Issue 56 item 4: a megatron-core user who sets fp8, fp4, tp_comm_overlap or CUDA graphs
    on the TransformerConfig itself passes no flag, so only the flag check refused them and
    the first micro-step crashed on a GPU: DCPForwardBackward refuses them by field, before
    any collective."""
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig

    from megatron_dcp.megatron.step import DCPForwardBackward

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               calculate_per_token_loss=True)
    object.__setattr__(config, field, value)  # as a user's config holds it (no TE check here)
    step = DCPForwardBackward(DCPConfig(enabled=True))
    with pytest.raises(ValueError, match=rf"DCP does not support TransformerConfig\.{field}="):
        step._check(SimpleNamespace(config=config), forward_only=False)
    plain = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                              calculate_per_token_loss=True)
    from megatron_dcp.megatron.args import fixed_shape_problems

    assert fixed_shape_problems(plain, config_fields=True) == []  # the control: nothing set
