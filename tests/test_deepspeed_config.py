"""DeepSpeed plugin, no launch: flags, the "dcp" section, start-up checks, config preparation,
ZeRO-3 slot assignment and the data-parallel split."""

import argparse

import pytest

from deepspeed_plugin import add_dcp_arguments
from megatron_dcp.runtime.step import data_parallel_plan
from deepspeed_plugin.config import check_supported, dcp_config_from, prepare_config
from megatron_dcp.config import DCPConfig, DCPConfigError


def test_flags_generated_from_dcpconfig():
    parser = argparse.ArgumentParser()
    add_dcp_arguments(parser)
    args = parser.parse_args(["--dcp", "--dcp_max_degree", "2", "--dcp_attention_layout", "ring"])
    cfg = dcp_config_from({"dcp": {"recompute": "none"}}, args)
    assert cfg.enabled and cfg.max_degree == 2 and cfg.attention_layout == "ring"
    assert cfg.recompute == "none"  # from the JSON section; flags given override it
    help_text = parser.format_help()
    assert "--dcp_memory_budget_gb" in help_text and "Largest sequence-parallel degree" in help_text


def test_unknown_dcp_key_is_an_error():
    with pytest.raises(DCPConfigError, match="unknown key.*max_degre"):
        dcp_config_from({"dcp": {"max_degre": 2}})


def test_dcp_knobs_without_dcp_are_an_error():
    parser = add_dcp_arguments(argparse.ArgumentParser())
    with pytest.raises(DCPConfigError, match="--dcp_max_degree given without --dcp"):
        dcp_config_from({}, parser.parse_args(["--dcp_max_degree", "2"]))
    # a "dcp" section turns DCP on, so its knobs (and flags on top) are used
    cfg = dcp_config_from({"dcp": {}}, parser.parse_args(["--dcp_max_degree", "2"]))
    assert cfg.enabled and cfg.max_degree == 2
    # the loss reduction also applies to plain data parallel
    cfg = dcp_config_from({}, parser.parse_args(["--dcp_loss_reduction", "sequence"]))
    assert not cfg.enabled and cfg.loss_reduction == "sequence"


def test_start_checks():
    on = DCPConfig(enabled=True, max_degree=4)
    with pytest.raises(DCPConfigError, match="max_degree=4 exceeds the DCP world size 2"):
        check_supported({}, on, world_size=2)
    ok = DCPConfig(enabled=True)
    with pytest.raises(DCPConfigError, match="sequence_parallel_size=2"):
        check_supported({"sequence_parallel_size": 2}, ok, world_size=2)
    with pytest.raises(DCPConfigError, match="pipeline"):
        check_supported({"pipeline": {"stages": 2}}, ok, world_size=2)
    pipe = pytest.importorskip("deepspeed.pipe")

    class FakePipe(pipe.PipelineModule):
        def __init__(self):  # no process groups needed for the isinstance check
            pass

    with pytest.raises(DCPConfigError, match="PipelineModule"):
        check_supported({}, ok, world_size=2, model=FakePipe())
    check_supported({"sequence_parallel_size": 2}, DCPConfig(), world_size=2)  # DCP off: no check


def test_prepare_config_makes_defaults_explicit():
    cfg, notices = prepare_config({"gradient_accumulation_steps": 4, "dcp": {},
                                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                                  world_size=4, cpu=True)
    assert "dcp" not in cfg
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["train_batch_size"] == 4
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert any("gradient_clipping" in n for n in notices)
    assert any("gradient_accumulation_steps=4" in n for n in notices)
    cfg, notices = prepare_config({"gradient_clipping": 0.0}, world_size=2, cpu=False)
    assert cfg["gradient_clipping"] == 0.0 and not notices


def test_zero3_keeps_its_settings_with_dcp_and_keeps_parameters_gathered_only_when_free():
    # lockstep (the default for ZeRO-3): partitioning, persistence and prefetch are ZeRO-3's
    for dcp in (DCPConfig(enabled=True), DCPConfig()):
        cfg, notices = prepare_config({"zero_optimization": {"stage": 3}}, world_size=2,
                                      cpu=False, dcp=dcp, largest_param_numel=12345)
        assert cfg["zero_optimization"] == {"stage": 3}
        assert not any("ZeRO-3" in n for n in notices)
    cfg, notices = prepare_config({"zero_optimization": {"stage": 3}}, world_size=2, cpu=False,
                                  dcp=DCPConfig(enabled=True, schedule="free"),
                                  largest_param_numel=12345)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 12345
    assert any("ZeRO-3" in n for n in notices)


def test_data_parallel_plan():
    plan = data_parallel_plan([5, 6, 7, 8, 9], 2)
    assert [t.seqs for t in plan.tasks_for_rank(0)] == [(0,), (2,), (4,)]
    assert [t.seqs for t in plan.tasks_for_rank(1)] == [(1,), (3,)]
    assert all(t.degree == 1 and t.recompute_layers == 0 for t in plan.tasks)
    assert plan.target_tokens == 4 + 5 + 6 + 7 + 8
    assert data_parallel_plan([3], 4).tasks_for_rank(3) == []


def test_patches_are_named_and_reversible():
    import importlib

    from deepspeed_plugin import patches

    module = importlib.import_module("deepspeed.comm.torch")
    original = module.build_shm_op
    patches.apply_all()
    assert "skip_shm_op_build" in patches.applied()
    assert module.build_shm_op() is None and module.build_shm_op is not original
    patches.undo_all()
    assert module.build_shm_op is original and patches.applied() == []


def test_patches_refuse_an_unchecked_deepspeed_version(monkeypatch):
    """One version policy for both engines: an untested DeepSpeed is refused, nothing patched."""
    import importlib

    from deepspeed_plugin import patches
    from megatron_dcp import patching

    module = importlib.import_module("deepspeed.comm.torch")
    original = module.build_shm_op
    monkeypatch.setattr(patching, "package_version", lambda package: (0, 99, 1))
    with pytest.raises(patching.PatchVersionError, match="deepspeed 0.99.1 is not supported"):
        patches.apply_all()
    assert module.build_shm_op is original and patches.applied() == []


def test_settings_that_move_the_reduction_are_refused_with_dcp():
    on = DCPConfig(enabled=True)
    with pytest.raises(DCPConfigError, match="managed_gradient_accumulation=false"):
        check_supported({"managed_gradient_accumulation": False}, on, world_size=2)
    with pytest.raises(DCPConfigError, match="zero_optimization.zenflow"):
        check_supported({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, on,
                        world_size=2)
    # DCP off: plain DeepSpeed decides; the hook-reducing settings run under DCP
    check_supported({"managed_gradient_accumulation": False}, DCPConfig(), world_size=2)
    for stage in (0, 1, 2, 3):
        check_supported({"zero_optimization": {
            "stage": stage, "overlap_comm": True, "reduce_bucket_size": 2000,
            "allgather_bucket_size": 2000, "contiguous_gradients": False,
            "reduce_scatter": False}}, on, world_size=2)
