"""The planner's MoE shape from Megatron's flags (`megatron_dcp.megatron.moe_shape`), both
shape builders (examples/pretrain_megatron.py, the Megatron-LM launcher): single process."""

from __future__ import annotations

import argparse

import pytest

from megatron_dcp.megatron.args import DCPArgumentError
from megatron_dcp.megatron.moe_shape import moe_shape_fields
from megatron_dcp.plan.model import ModelShape


def _lm_args(**moe) -> argparse.Namespace:
    return argparse.Namespace(num_layers=4, hidden_size=32, num_attention_heads=4,
                              ffn_hidden_size=None, padded_vocab_size=256, num_query_groups=None,
                              group_query_attention=False, seq_length=128,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              sequence_parallel=False, **moe)


MOE = dict(num_experts=4, moe_router_topk=2, expert_model_parallel_size=2,
           moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32)


def test_moe_flags_give_the_fields():
    fields = moe_shape_fields(_lm_args(**MOE))
    assert fields == dict(num_experts=4, moe_topk=2, moe_ffn_hidden_size=48,
                          moe_shared_expert_ffn=32, moe_dense_layers=0, expert_parallel=2)


def test_dense_args_give_todays_shape():
    from megatron_dcp.megatron.lm import model_shape_from_args

    args = _lm_args()
    assert moe_shape_fields(args) == {}
    assert model_shape_from_args(args) == ModelShape(
        num_layers=4, hidden_size=32, num_heads=4, ffn_hidden_size=128, vocab_size=256,
        num_kv_heads=4, max_position=128, name="megatron-lm-gpt", tensor_parallel=1,
        pipeline_parallel=1, sequence_parallel=False,
        # no Transformer Engine here: Megatron's local layer, its vocabulary-parallel loss
        layer_memory="megatron-local", loss_memory="megatron-vocab-parallel")


def test_launcher_shape_is_moe():
    from megatron_dcp.megatron.lm import model_shape_from_args

    shape = model_shape_from_args(_lm_args(**MOE))
    assert shape.is_moe and shape.expert_parallel == 2 and shape.moe_ffn_hidden_size == 48
    assert shape.ffn_hidden_size == 128  # the dense layers' (none here)


def test_layer_freq():
    lead = moe_shape_fields(_lm_args(**MOE, moe_layer_freq=[0, 1, 1, 1]))
    assert lead["moe_dense_layers"] == 1
    assert moe_shape_fields(_lm_args(**MOE, moe_layer_freq=2))["moe_dense_layers"] == 2
    with pytest.raises(DCPArgumentError, match="--moe-layer-freq"):
        moe_shape_fields(_lm_args(**MOE, moe_layer_freq=[0, 0, 0, 0]))
    with pytest.raises(DCPArgumentError, match="--moe-layer-freq"):
        moe_shape_fields(_lm_args(**MOE, moe_layer_freq=[1, 1]))


@pytest.mark.parametrize("extra, message", [
    (dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size dividing"),
    (dict(expert_model_parallel_size=3), "--num-experts 4"),
    (dict(world_size=3), "data-parallel size 3"),
])
def test_bad_layouts_name_the_flags(extra, message):
    with pytest.raises(DCPArgumentError, match=message):
        moe_shape_fields(_lm_args(**{**MOE, **extra}))


def test_tp_x_ep_is_accepted():
    args = _lm_args(**MOE, expert_tensor_parallel_size=2, world_size=8)
    args.tensor_model_parallel_size = 2
    assert moe_shape_fields(args)["expert_parallel"] == 2


def test_example_shape_sets_the_fields():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import pretrain_megatron as pm

    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "64"]
    dense = pm.model_shape(pm.parse_args(flags))
    assert not dense.is_moe
    moe = pm.model_shape(pm.parse_args(flags + [
        "--num-experts", "4", "--expert-model-parallel-size", "2",
        "--moe-ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "32"]))
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size, moe.moe_shared_expert_ffn,
            moe.expert_parallel) == (4, 2, 48, 32, 2)


@pytest.mark.parametrize("tp, ep, etp, span, lockstep", [
    (2, 2, 1, 1, False),  # EP group = one DCP rank's TP group: no lockstep across DCP ranks
    (4, 2, 1, 1, False),  # two EP groups inside one TP group
    (2, 4, 1, 2, True),   # EP group: the TP groups of two DCP ranks
    (2, 2, 2, 2, True),   # Megatron's default ETP = TP: EP DCP ranks of one TP rank
    (4, 4, 2, 2, True),
])
def test_expert_tensor_parallel_below_tp(tp, ep, etp, span, lockstep):
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.moe import moe_schedule
    from megatron_dcp.plan.geometry import Geometry
    from megatron_dcp.plan.hardware import load_hardware

    args = _lm_args(**{**MOE, "num_experts": 8, "expert_model_parallel_size": ep},
                    expert_tensor_parallel_size=etp, world_size=8 * tp)
    args.tensor_model_parallel_size, args.sequence_parallel, args.num_attention_heads = \
        tp, True, 8
    fields = moe_shape_fields(args)
    assert fields.get("expert_tensor_parallel", tp) == etp
    shape = ModelShape(num_layers=4, hidden_size=64, num_heads=8, ffn_hidden_size=128,
                       vocab_size=256, tensor_parallel=tp, sequence_parallel=True, **fields)
    assert shape.expert_dcp_ranks == span
    schedule = moe_schedule(args, DCPConfig(schedule="auto")).schedule
    assert (schedule == "lockstep") == lockstep
    # a rank holds 8 experts / (EP x ETP) whole-expert equivalents, whatever TP is
    geometry = Geometry(shape, load_hardware("h100"), world_size=8)
    expert = 3 * 64 * 48  # gated MLP: 3 matrices of hidden x expert width
    assert geometry.expert_params == pytest.approx(4 * 8 * expert / (ep * etp))


def test_expert_groups_across_parts_of_tp_groups_are_refused():
    args = _lm_args(**{**MOE, "expert_model_parallel_size": 2},
                    expert_tensor_parallel_size=2, world_size=16)
    args.tensor_model_parallel_size = 8  # EP x ETP = 4 divides TP: fine
    assert moe_shape_fields(args)["expert_tensor_parallel"] == 2
    args.tensor_model_parallel_size, args.expert_tensor_parallel_size = 4, 3
    with pytest.raises(DCPArgumentError, match="--expert-tensor-parallel-size dividing"):
        moe_shape_fields(args)
    with pytest.raises(ValueError, match="expert_tensor_parallel=3"):
        ModelShape(num_layers=4, hidden_size=64, num_heads=8, ffn_hidden_size=128,
                   vocab_size=256, tensor_parallel=4, num_experts=4, expert_parallel=2,
                   expert_tensor_parallel=3)
