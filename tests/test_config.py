"""DCPConfig: one dataclass, three faces (DeepSpeed flags, Megatron flags, JSON section)."""

import argparse

import pytest

from megatron_dcp.config import DCPConfig, DCPConfigError


def _parse(style, argv):
    parser = argparse.ArgumentParser()
    DCPConfig.add_arguments(parser, style=style)
    return parser.parse_args(argv)


def test_deepspeed_and_megatron_flags_give_the_same_config():
    ds = DCPConfig.from_args(_parse("deepspeed", ["--dcp", "--dcp_max_degree", "4",
                                                  "--dcp_attention_layout", "ring"]))
    mg = DCPConfig.from_args(_parse("megatron", ["--dcp", "--dcp-max-degree", "4",
                                                 "--dcp-attention-layout", "ring"]))
    assert ds == mg
    assert ds.enabled and ds.max_degree == 4 and ds.attention_layout == "ring"


def test_deepspeed_style_takes_both_spellings():
    """The DeepSpeed example's own flags use dashes (``--train-iters``): ``--dcp-memory-budget-gb``
    is accepted beside ``--dcp_memory_budget_gb`` (was "unrecognized arguments")."""
    dashed = DCPConfig.from_args(_parse("deepspeed", ["--dcp", "--dcp-memory-budget-gb", "3",
                                                      "--dcp-skip-nonfinite"]))
    underscored = DCPConfig.from_args(_parse("deepspeed", ["--dcp", "--dcp_memory_budget_gb", "3",
                                                           "--dcp_skip_nonfinite"]))
    assert dashed == underscored and dashed.memory_budget_gb == 3 and dashed.skip_nonfinite
    with pytest.raises(SystemExit):  # Megatron's style stays Megatron's: dashes only
        _parse("megatron", ["--dcp_max_degree", "4"])


def test_flags_override_json_section_and_defaults_stay():
    base = DCPConfig.from_dict({"max_degree": 2, "memory_budget_gb": 40})
    assert base.enabled  # a "dcp" section turns DCP on
    cfg = DCPConfig.from_args(_parse("deepspeed", ["--dcp_max_degree", "8"]), base=base)
    assert cfg.max_degree == 8 and cfg.memory_budget_gb == 40 and cfg.policy == "dcp"


def test_every_field_has_a_flag_with_help():
    parser = argparse.ArgumentParser()
    DCPConfig.add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    for name in DCPConfig.__dataclass_fields__:
        dest = "dcp" if name == "enabled" else "dcp_" + name
        assert dest in helps and len(helps[dest]) > 20, name


def test_json_round_trip():
    cfg = DCPConfig(enabled=True, max_degree=3, oversize="skip")
    assert DCPConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "section, message",
    [
        ({"max_degre": 2}, "unknown key"),
        ({"policy": "magic"}, "dcp.policy"),
        ({"max_degree": 0}, "dcp.max_degree"),
        ({"memory_budget_gb": -1}, "dcp.memory_budget_gb"),
        ({"memory_fraction": 1.5}, "dcp.memory_fraction"),
        ({"attention_layout": "zigzag"}, "dcp.attention_layout"),
    ],
)
def test_bad_sections_name_the_key(section, message):
    with pytest.raises(DCPConfigError, match=message):
        DCPConfig.from_dict(section)


def test_degree_cap_above_world_is_an_error():
    with pytest.raises(DCPConfigError, match="exceeds the DCP world size 2"):
        DCPConfig(max_degree=4).check_world(2)


def test_old_names_of_fields_are_refused():
    """``recompute`` and ``oversize`` were ``checkpoint_policy`` and ``oversize_policy`` before
    0.1.0, never released: the old JSON keys and flags are errors, not aliases."""
    import argparse

    import pytest

    from megatron_dcp.config import DCPConfig, DCPConfigError

    with pytest.raises(DCPConfigError, match="unknown key.*checkpoint_policy"):
        DCPConfig.from_dict({"checkpoint_policy": "none"})
    for style, flag in (("deepspeed", "--dcp_checkpoint_policy"),
                        ("megatron", "--dcp-oversize-policy")):
        parser = DCPConfig.add_arguments(argparse.ArgumentParser(), style=style)
        assert parser.parse_known_args(["--dcp", flag, "full"])[1] == [flag, "full"]


def test_a_task_key_the_format_does_not_have_is_refused():
    """``ckpt_layers`` (the old name of ``recompute_layers``) or any misspelt key is an error
    naming it, not a task that silently recomputes nothing."""
    import pytest

    from megatron_dcp.plan.plan import Plan

    plan = {"world_size": 1, "lengths": [4], "tasks": [{"id": 0, "ranks": [0], "seqs": [0],
                                                          "recompute_layers": 2}]}
    assert Plan.from_dict(plan).tasks[0].recompute_layers == 2
    plan["tasks"][0]["ckpt_layers"] = plan["tasks"][0].pop("recompute_layers")
    with pytest.raises(ValueError, match="plan task \\[0\\]: unknown key\\(s\\) 'ckpt_layers'"):
        Plan.from_dict(plan)