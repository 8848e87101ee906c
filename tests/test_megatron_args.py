"""Megatron flags for DCP: generation from DCPConfig, validation against Megatron's arguments;
the CPU and CP-group patches being reversible and refusing an unchecked megatron-core version."""

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
    ("--dcp --calculate-per-token-loss --pipeline-model-parallel-size 2",
     "--pipeline-model-parallel-size"),
    ("--dcp --calculate-per-token-loss --context-parallel-size 2", "--context-parallel-size 1"),
    ("--dcp --calculate-per-token-loss --hybrid-context-parallel", "--hybrid-context-parallel"),
    ("--dcp --calculate-per-token-loss --sequence-parallel", "--sequence-parallel"),
    ("--dcp --calculate-per-token-loss --recompute-granularity selective", "selective"),
    ("--dcp --calculate-per-token-loss --overlap-grad-reduce --overlap-param-gather",
     "--overlap-param-gather: .* runs no forward"),
    ("--dcp --calculate-per-token-loss --dcp-max-degree 8", "exceeds the DCP world size 4"),
    ("--dcp --calculate-per-token-loss --tensor-model-parallel-size 2 --dcp-attention-layout "
     "ulysses --dcp-max-degree 4 --num-attention-heads 4", "divisible by the degree"),
])
def test_bad_combinations_fail_with_a_clear_message(line, message):
    with pytest.raises(DCPArgumentError, match=message):
        validate_dcp_args(parse(line), world_size=4 if "tensor" not in line else 8)


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

    from megatron_dcp.megatron.cpu import cpu_enabled, cpu_patches

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


def test_task_cp_group_patches_follow_the_task_and_are_reversible(monkeypatch):
    """Inside a task Megatron's CP getters (also aliases bound by name in other ``megatron.*``
    modules) and a captured ``pg_collection.cp`` answer for the task; all of it undoes."""
    import sys
    import types

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_dcp.megatron.parallel import (disable_task_cp_groups,
                                                make_pg_collections_dynamic,
                                                restore_pg_collections, task_cp_groups)
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime.context import TaskContext, task_context

    disable_task_cp_groups()
    names = ("get_context_parallel_world_size", "get_context_parallel_rank",
             "get_context_parallel_group")
    originals = {n: getattr(ps, n) for n in names}
    alias = types.ModuleType("megatron._dcp_alias_test")
    alias.get_context_parallel_world_size = originals["get_context_parallel_world_size"]
    monkeypatch.setitem(sys.modules, alias.__name__, alias)
    group, own = object(), object()
    ctx = TaskContext(task=Task(id=5, ranks=(2, 0, 1), seqs=(0,), ulysses=1, ring=3),
                      group_rank=1, group=group)
    holder = torch.nn.Module()
    holder.pg_collection = ProcessGroupCollection(cp=own)
    assert make_pg_collections_dynamic(holder) == 1
    with task_cp_groups():
        with task_context(ctx):
            assert ps.get_context_parallel_world_size() == 3
            assert alias.get_context_parallel_world_size() == 3
            assert ps.get_context_parallel_rank() == 1
            assert ps.get_context_parallel_group() is group
            assert holder.pg_collection.cp is group
        assert holder.pg_collection.cp is own
    for name, original in originals.items():
        assert getattr(ps, name) is original, name
    assert alias.get_context_parallel_world_size is originals["get_context_parallel_world_size"]
    restore_pg_collections(holder)
    assert type(holder.pg_collection) is ProcessGroupCollection and holder.pg_collection.cp is own


def test_patches_refuse_an_unchecked_megatron_version(monkeypatch):
    from megatron.core import parallel_state as ps

    from megatron_dcp import patching
    from megatron_dcp.megatron import parallel

    parallel.disable_task_cp_groups()
    original = ps.get_context_parallel_group
    monkeypatch.setattr(patching, "package_version", lambda package: (0, 99, 0))
    with pytest.raises(patching.PatchVersionError, match="megatron-core 0.99.0 is not"):
        parallel.enable_task_cp_groups()
    assert parallel._ACTIVE is None and ps.get_context_parallel_group is original
