"""The examples' precision follows the device (bf16 on CUDA, fp32 on CPU, flags and configs
choose), and pretrain_megatron.py builds both modes from one layer implementation (issue 18,
items 4 and 8). CUDA and Transformer Engine are faked: only the deciding functions run."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron_dcp.megatron.internals import module_submodules

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
warnings.filterwarnings("ignore")


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("flags, on_cuda, on_cpu", [
    ([], torch.bfloat16, torch.float32),
    (["--fp32"], torch.float32, torch.float32),
    (["--bf16"], torch.bfloat16, torch.bfloat16),
])
def test_megatron_precision_follows_the_device_unless_chosen(monkeypatch, cuda, flags, on_cuda,
                                                             on_cpu):
    import pretrain_megatron

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = pretrain_megatron.parse_args(flags)
    assert pretrain_megatron.params_dtype(args) == (on_cuda if cuda else on_cpu)


def test_megatron_precision_flags_exclude_each_other():
    import pretrain_megatron

    with pytest.raises(SystemExit):
        pretrain_megatron.parse_args(["--bf16", "--fp32"])


@pytest.mark.parametrize("te", [True, False])
def test_megatron_modes_share_the_layer_implementation(monkeypatch, te):
    """With Transformer Engine installed both modes take its layer (the baseline used to take the
    local one); without it both take the local layer. Only the core attention differs."""
    from megatron.core.models.gpt import gpt_layer_specs

    import pretrain_megatron
    from megatron_dcp.megatron.spec import DCPCoreAttention

    class FakeTELinear(torch.nn.Module):
        """Stands for TE's fused linear (TE is not installed here)."""

    def te_spec(**kwargs):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.self_attention.submodules.linear_qkv = FakeTELinear
        return spec

    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", te, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    dcp, baseline = pretrain_megatron.layer_spec(True), pretrain_megatron.layer_spec(False)
    a, b = dcp.submodules.self_attention.submodules, baseline.submodules.self_attention.submodules
    assert (a.linear_qkv is FakeTELinear) == te and (b.linear_qkv is FakeTELinear) == te
    assert a.linear_qkv is b.linear_qkv and a.linear_proj is b.linear_proj
    fc1 = [module_submodules(spec.submodules.mlp).linear_fc1 for spec in (dcp, baseline)]
    assert fc1[0] is fc1[1]
    assert a.core_attention is DCPCoreAttention and b.core_attention is not DCPCoreAttention


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("config, want", [
    ({}, "device"),  # examples/ds_config*.json name no precision
    ({"bf16": {"enabled": False}}, {"enabled": False}),
    ({"fp16": {"enabled": True}}, None),
])
def test_deepspeed_examples_default_to_bf16_on_cuda(monkeypatch, cuda, config, want):
    import training

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    got = training.with_default_precision(dict(config)).get("bf16")
    if want == "device":
        want = {"enabled": True} if cuda else None
    assert got == want


def test_deepspeed_example_config_gets_the_default(monkeypatch, tmp_path):
    pytest.importorskip("deepspeed")
    import pretrain_video
    import training

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = pretrain_video.parse_args(["--deepspeed_config", training.DEFAULT_DS_CONFIG])
    assert training.ds_config(args)["bf16"] == {"enabled": True}
    assert "precision: bf16 on CUDA" in training.argument_parser("x")[0].format_help()
