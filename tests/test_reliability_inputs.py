"""Reliability of inputs: bad values in the "dcp" section, a plan JSON, a lengths file or the
examples' flags get an error naming the field (or flag) and the value, never a coercion, a
``ZeroDivisionError`` or a run that silently does nothing."""

import copy
import sys
from pathlib import Path

import pytest
from conftest import load_example

from deepspeed_plugin.config import dcp_config_from
from megatron_dcp.config import DCPConfig, DCPConfigError
from megatron_dcp.plan.plan import Plan
from megatron_dcp.plan.workload import WorkloadError, read_lengths_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("section, message", [
    ({"memory_budget_gb": "10"}, r"dcp.memory_budget_gb='10' \(str\): must be a finite number"),
    ({"enabled": "no"}, r"dcp.enabled='no' \(str\): must be true or false"),
    ({"max_degree": True}, r"dcp.max_degree=True \(bool\): must be an integer"),
    ({"pack_tokens": 100.5}, r"dcp.pack_tokens=100.5 \(float\): must be an integer"),
    ({"memory_fraction": float("nan")}, r"dcp.memory_fraction=nan .*finite"),
    ({"policy": 3}, r"dcp.policy=3 \(int\): must be a string"),
    ({"ranks_per_node": "8"}, r"dcp.ranks_per_node='8'"),
])
def test_dcp_section_types_are_checked(section, message):
    with pytest.raises(DCPConfigError, match=message):
        dcp_config_from({"dcp": section})


def test_dcp_section_good_values_still_load():
    cfg = DCPConfig.from_dict({"memory_budget_gb": 10, "max_degree": 4, "enabled": False,
                               "pack_tokens": None})
    assert cfg.memory_budget_gb == 10 and cfg.max_degree == 4 and not cfg.enabled


PLAN = {"world_size": 2, "lengths": [5, 6],
        "tasks": [{"id": 0, "ranks": [0, 1], "seqs": [0, 1], "ulysses": 2}]}


@pytest.mark.parametrize("change, message", [
    (lambda d: d["tasks"][0].update(ulysses=0), r"task \[0\].ulysses=0: must be >= 1"),
    (lambda d: d.update(lengths=[5, 6.5]), r"plan lengths\[1\]=6.5: must be an integer"),
    (lambda d: d["tasks"][0].update(ranks="01"), r"task \[0\].ranks='01': must be a list"),
    (lambda d: d.update(world_size=10 ** 9), "world_size=1000000000: more than"),
    (lambda d: d.update(world_size=2.0), "world_size=2.0: must be an integer"),
    (lambda d: d["tasks"][0].update(start=float("inf")), r"task \[0\].start=inf"),
    (lambda d: d["tasks"][0].update(ring=2), "ulysses 2 x ring 2 != 2 ranks"),
    (lambda d: d["tasks"][0].pop("seqs"), "lacks the key 'seqs'"),
    (lambda d: d["tasks"].append(7), r"task \[1\] must be an object"),
])
def test_plan_json_is_checked(change, message):
    assert Plan.from_dict(copy.deepcopy(PLAN)).tasks[0].ring == 1
    bad = copy.deepcopy(PLAN)
    change(bad)
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(bad)


def test_binary_lengths_file_is_a_clear_error(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_bytes(b"\x00\xff\xfe\x81")
    with pytest.raises(WorkloadError, match="lengths.txt' is not text"):
        read_lengths_file(str(path))


def _example(name: str):
    return load_example(name)


def test_the_launchers_log_path_is_checked_while_parsing(tmp_path, capsys):
    """Issue 48, item 13: the launcher's ``--dcp-log-json`` in a missing folder is refused by
    Megatron-LM's parser (its ``extra_args_provider``), not when the first row is written."""
    import argparse

    from megatron_dcp.megatron.lm import add_launcher_args

    parser = add_launcher_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--dcp-log-json", str(tmp_path / "missing" / "log.jsonl")])
    err = capsys.readouterr().err
    assert "--dcp-log-json" in err and "does not exist" in err, err
    assert parser.parse_args(["--dcp-log-json", str(tmp_path / "a.jsonl")]).dcp_log_json


@pytest.mark.parametrize("script", ["pretrain.py", "pretrain_megatron.py", "pretrain_video.py"])
def test_an_unwritable_log_path_is_refused_at_start(script, tmp_path, capsys):
    """Issue 48: ``--log-json`` in a missing folder (or a folder) is refused while parsing,
    not as a bare FileNotFoundError after the model is built."""
    module = _example(script)
    for path, said in ((tmp_path / "missing" / "log.jsonl", "does not exist"),
                       (tmp_path, "is a folder")):
        with pytest.raises(SystemExit):
            module.parse_args(["--log-json", str(path)])
        err = capsys.readouterr().err
        assert "--log-json" in err and said in err, err
    module.parse_args(["--log-json", str(tmp_path / "log.jsonl")])


@pytest.mark.parametrize("script", ["pretrain.py", "pretrain_megatron.py", "pretrain_video.py",
                                    "launcher"])
def test_the_timeline_interval_flag(script, capsys):
    """``--log-timeline-interval N`` (examples) and ``--dcp-log-timeline-interval N`` (the
    launcher): default `TIMELINE_INTERVAL`, 0 allowed (never), a negative N refused."""
    import argparse

    from megatron_dcp.megatron.lm import add_launcher_args
    from megatron_dcp.runtime.report import TIMELINE_INTERVAL

    if script == "launcher":
        parse, flag = add_launcher_args(argparse.ArgumentParser()).parse_args, \
            "--dcp-log-timeline-interval"
    else:
        parse, flag = _example(script).parse_args, "--log-timeline-interval"
    dest = flag.lstrip("-").replace("-", "_")
    assert getattr(parse([]), dest) == TIMELINE_INTERVAL == 100
    assert getattr(parse([flag, "7"]), dest) == 7 and getattr(parse([flag, "0"]), dest) == 0
    with pytest.raises(SystemExit):
        parse([flag, "-1"])
    assert flag in capsys.readouterr().err



@pytest.mark.parametrize("script, flags, message", [
    ("pretrain.py", ["--num-kv-heads", "0"], "--num-kv-heads: 0: must be >= 1"),
    ("pretrain.py", ["--train-iters", "-2"], "--train-iters: -2: must be >= 1"),
    ("pretrain.py", ["--lr", "nan"], "--lr: nan: must be a finite number"),
    ("pretrain.py", ["--save-interval", "-1"], "--save-interval: -1: must be >= 0"),
    ("pretrain_megatron.py", ["--num-query-groups", "0"], "--num-query-groups: 0: must be >= 1"),
    ("pretrain_megatron.py", ["--train-iters", "0"], "--train-iters: 0: must be >= 1"),
    ("pretrain_megatron.py", ["--seq-length", "x"], "--seq-length: 'x' is not an integer"),
    # issue 31: as the DeepSpeed example refuses them
    ("pretrain_megatron.py", ["--save-interval", "-1"], "--save-interval: -1: must be >= 0"),
    ("pretrain_megatron.py", ["--save", ""], "--save: checkpoint directory '' is an empty name"),
    ("pretrain.py", ["--save", ""], "--save: checkpoint directory '' is an empty name"),
    ("pretrain_megatron.py", ["--lr", "1e39"], "--lr: 1e+39: must be below 3.403e+38"),
    ("pretrain.py", ["--lr", "1e39"], "--lr: 1e+39: must be below 3.403e+38"),
    ("pretrain_video.py", ["--lr", "1e39"], "--lr: 1e+39: must be below 3.403e+38"),
])
def test_example_flags_are_checked(script, flags, message, capsys):
    module = _example(script)
    with pytest.raises(SystemExit):
        module.parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("script", ["pretrain.py", "pretrain_megatron.py", "pretrain_video.py"])
def test_save_into_another_runs_checkpoints_is_refused_at_start(script, tmp_path, capsys):
    """Issue 48: ``--save DIR`` without ``--load DIR``, where DIR holds another run's
    checkpoints, is refused while parsing; with ``--load DIR`` (resuming that run) it parses."""
    from megatron_dcp.runtime.checkpoint_dir import save_atomically

    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        save_atomically(str(root), f"iter_{step}",
                        lambda tag: (root / tag).mkdir() or {}, meta={"iteration": step})
    module = _example(script)
    with pytest.raises(SystemExit):
        module.parse_args(["--save", str(root)])
    said = capsys.readouterr().err
    assert f"--save {root} holds another run's checkpoints" in said and "--load" in said
    module.parse_args(["--save", str(root), "--load", str(root)])


# ------------------------------------------------------------------ issue 22: --hf-model
@pytest.mark.parametrize("config_name, kind", [("BertConfig", "bert"), ("GPT2Config", "gpt2")])
def test_unsupported_hf_architecture_is_refused_naming_it(tmp_path, config_name, kind):
    """A BERT config trained with bidirectional attention under a next-token loss, a GPT-2 config
    failed with an AttributeError: both are refused at start, naming what is supported."""
    transformers = pytest.importorskip("transformers")
    from megatron_dcp.integrations import hf

    config = getattr(transformers, config_name)(vocab_size=300, hidden_size=32, n_embd=32,
                                                num_hidden_layers=1, n_layer=1,
                                                num_attention_heads=2, n_head=2)
    config.save_pretrained(tmp_path)
    want = rf"architecture '{kind}' .* not supported by DCP; supported: llama, qwen2, mistral"
    with pytest.raises(ValueError, match=want):
        hf.load_causal_lm(str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=want):
        hf.enable(model)


# ------------------------------------------------------------------ issue 31: clear words
def test_indivisible_world_names_the_model_parallel_size_only():
    from megatron_dcp.megatron.args import DCPArgumentError, validate_dcp_args

    args = _example("pretrain_megatron.py").parse_args(["--dcp", "--calculate-per-token-loss",
                                                        "--tensor-model-parallel-size", "2"])
    with pytest.raises(DCPArgumentError) as err:
        validate_dcp_args(args, world_size=3)
    assert "world size 3 is not divisible by tensor x pipeline x context parallel size 2" in \
        str(err.value) and "(the data-parallel size)" not in str(err.value)


def _simulate(tmp_path, lengths) -> str:
    import subprocess

    path = tmp_path / "lengths.txt"
    path.write_text("".join(f"{n}\n" for n in lengths))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "simulate.py"), "--gpus", "2",
                           "--lengths", str(path), "--oversize", "skip", "--policy",
                           "dcp,bucket"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_simulate_shows_skipped_sequences_and_no_efficiency_when_all_are(tmp_path):
    some = _simulate(tmp_path, [1000, 3_000_000])
    assert "skipped" in some.splitlines()[2]  # the table's head
    assert "dcp: --oversize skip left out 1 of 2 sequences (3000000 tokens)" in some
    every = _simulate(tmp_path, [3_000_000, 4_000_000])
    row = next(line for line in every.splitlines() if line.startswith("dcp "))
    assert "1.000" not in row and " - " in row
    assert "left out 2 of 2 sequences (7000000 tokens)" in every and "no efficiency" in every


def test_a_dcp_flag_without_dcp_through_the_launcher_says_to_add_it(tmp_path, capsys):
    """Issue 48 item 13: Megatron-LM's parser said "unrecognized arguments: --dcp-max-degree"
    (DCP's flags are added with --dcp only), not how to fix it."""
    from megatron_dcp.megatron.run import main

    script = tmp_path / "pretrain.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    assert main([str(script), "--dcp-max-degree", "2", "--dcp-pack-tokens=64"]) == 2
    err = capsys.readouterr().err
    assert "--dcp-max-degree, --dcp-pack-tokens given without --dcp: add --dcp" in err


def test_a_bad_planner_state_is_named_and_never_blocks_the_checkpoint(tmp_path, capsys):
    """Issue 48 item 12: a truncated ``dcp_planner.json`` stopped a good checkpoint's load with a
    bare JSONDecodeError naming no file; now the file is named and the planner starts afresh."""
    from megatron_dcp.megatron.lm_checkpoint import read_planner_state

    good = tmp_path / "good.json"
    good.write_text('{"iteration": 4, "hardware": null}')
    assert read_planner_state(str(good)) == {"iteration": 4, "hardware": None}
    truncated = tmp_path / "dcp_planner.json"
    truncated.write_text('{"iteration": 4, "hardw')
    assert read_planner_state(str(truncated)) is None
    err = capsys.readouterr().err
    assert f"{truncated} is unreadable (JSONDecodeError" in err and "starts afresh" in err
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert read_planner_state(str(listed)) is None
    assert "holds a list" in capsys.readouterr().err


@pytest.mark.parametrize("state, said", [
    ({"iteration": "four"}, "has iteration 'four', not a count of steps"),
    ({"iteration": -1}, "has iteration -1"),
    ({"iteration": True}, "has iteration True"),
    ({"iteration": 4, "hardware": [1]}, "has hardware list, not a profile object"),
    ({"iteration": 4, "hardware": {"base": "h200", "peak_flops": "fast"}},
     "holds a hardware profile the planner refuses (its 'hardware': "),
    ({"iteration": 4, "hardware": {"base": "h200", "speed": 1}}, "unknown key(s) speed"),
])
def test_a_planner_state_of_wrong_types_is_skipped_not_fatal(tmp_path, capsys, state, said):
    """Issue 59: a ``dcp_planner.json`` of valid JSON with wrong types was returned as the
    state and failed the good checkpoint's run at its first step (``int('four')``, the profile
    reader); now its types are checked when read, and it is skipped with the file named."""
    import json

    from megatron_dcp.megatron.lm_checkpoint import read_planner_state
    from megatron_dcp.plan.hardware import PRESETS

    good = tmp_path / "good.json"
    good.write_text(json.dumps({"iteration": 4, "hardware": PRESETS["h200"].to_dict()}))
    assert read_planner_state(str(good))["iteration"] == 4
    bad = tmp_path / "dcp_planner.json"
    bad.write_text(json.dumps(state))
    assert read_planner_state(str(bad)) is None
    err = capsys.readouterr().err
    assert f"{bad} " in err and said in err and "the checkpoint itself loads" in err, err


def test_json_inputs_nested_too_deeply_are_refused_naming_the_file(tmp_path, capsys):
    """Issue 59: ``--dcp-hardware FILE``, a plan file and ``dcp_planner.json`` are read as JSON
    only; JSON nested deeper than Python's reader goes (a bare ``RecursionError`` naming no
    file before) is refused like any unreadable JSON."""
    from megatron_dcp.megatron.lm_checkpoint import read_planner_state
    from megatron_dcp.plan import load_hardware
    from megatron_dcp.plan.hardware import HardwareError

    deep = "[" * 100_000 + "]" * 100_000
    profile = tmp_path / "hw.json"
    profile.write_text(deep)
    with pytest.raises(HardwareError, match=f"{profile}.*not readable JSON: nested too deeply"):
        load_hardware(str(profile))
    with pytest.raises(ValueError, match="nested too deeply"):
        Plan.from_json(deep)
    state = tmp_path / "dcp_planner.json"
    state.write_text(deep)
    assert read_planner_state(str(state)) is None
    assert f"{state} is unreadable (RecursionError" in capsys.readouterr().err


def test_launcher_token_ids_outside_the_tokenizers_vocabulary_are_refused():
    """Issue 48 item 4: through the launcher, ids at or above the tokenizer's vocabulary
    trained the embedding's padding rows with status 0 (or failed inside a task past them);
    every rank sees the same gathered batch and refuses it, naming the document and the id."""
    import torch

    from megatron_dcp.megatron.lm_data import check_token_ids

    check_token_ids([torch.tensor([0, 5, 255]), torch.tensor([], dtype=torch.long)], 256)
    with pytest.raises(ValueError, match="document 1 of this step holds token id 256"):
        check_token_ids([torch.tensor([1, 2]), torch.tensor([3, 256, 4])], 256)
    with pytest.raises(ValueError, match="token id -1"):
        check_token_ids([torch.tensor([-1, 2])], 256)
