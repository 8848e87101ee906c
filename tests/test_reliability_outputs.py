"""Issue 59, item 2: the training front ends' output files never destroy what they did not write.
A ``--log-json`` / ``--dcp-log-json`` file is new, this run's own (a resume: kept up to the
loaded iteration, then continued) or refused while parsing, naming ``--overwrite-log``
(``--dcp-overwrite-log``); a log path that cannot be written and a ``--tensorboard-dir`` that
is a file are refused naming the flag; a ``--save`` inside another run's checkpoint is refused.
After every refusal the other run's files are byte-identical."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_example

from megatron_dcp.runtime.checkpoint_dir import save_atomically
from megatron_dcp.runtime.log_file import log_problem
from megatron_dcp.runtime.report import TrainingLog

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["pretrain.py", "pretrain_megatron.py", "pretrain_video.py"]
PLAN = {"mode": "data-parallel", "micro_steps_per_rank": 1}


def _example(name: str):
    return load_example(name)


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the SHA-256 of its bytes (and every folder)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def _log(path: Path, iterations, checkpoint_dir=None, resume_at=None) -> None:
    log = TrainingLog("dcp", 10, json_path=str(path), quiet=True, resume_at=resume_at,
                      checkpoint_dir=checkpoint_dir)
    for it in iterations:
        log.iteration(it, loss=float(it), tokens=1, step_s=1.0, plan=PLAN)
    log.close()


def _iterations(path: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()]


def _launcher_args(**given) -> argparse.Namespace:
    """The attributes `launcher_problems` reads, as Megatron-LM's parser leaves them."""
    base = dict(dataloader_inter_document_masking=True, spec=None, save=None, load=None,
                ckpt_step=None, finetune=False, tensorboard_dir=None, wandb_project=None,
                dcp_log_json=None, dcp_overwrite_log=False)
    return argparse.Namespace(**{**base, **given})


# ------------------------------------------------------- case 1: another run's log, no --load
@pytest.mark.parametrize("script", EXAMPLES)
def test_another_runs_log_is_refused_at_parse_and_kept(script, tmp_path, capsys):
    """Before: the other run's rows were truncated away by a run that did not --load it."""
    other = tmp_path / "other.jsonl"
    _log(other, [1, 2, 3], checkpoint_dir=str(tmp_path / "their_ckpt"))
    before = other.read_bytes()
    module = _example(script)
    for flags in (["--log-json", str(other)],  # no --load: never this run's log
                  ["--log-json", str(other), "--load", str(tmp_path / "mine")]):
        with pytest.raises(SystemExit):
            module.parse_args(flags)
        err = capsys.readouterr().err
        assert f"--log-json: --log-json {other}" in err and "--overwrite-log" in err, err
        assert "3 rows, iterations 1..3" in err, err
    assert other.read_bytes() == before
    # a file that is no log at all is another run's too
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(SystemExit):
        module.parse_args(["--log-json", str(notes)])
    assert "is not a training log (line 1" in capsys.readouterr().err
    assert notes.read_text() == "my notes\n"
    # asked for: replaced; a new or empty file: written
    assert module.parse_args(["--log-json", str(other), "--overwrite-log"]).overwrite_log
    (tmp_path / "empty.jsonl").touch()
    module.parse_args(["--log-json", str(tmp_path / "empty.jsonl")])
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    assert "--overwrite-log" in capsys.readouterr().out


def test_the_launcher_refuses_another_runs_log_naming_its_flag(tmp_path):
    from megatron_dcp.megatron.lm import add_launcher_args, launcher_problems

    other = tmp_path / "other.jsonl"
    _log(other, [1, 2], checkpoint_dir=str(tmp_path / "their_ckpt"))
    before = other.read_bytes()
    said = "\n".join(launcher_problems(_launcher_args(dcp_log_json=str(other))))
    assert f"--dcp-log-json {other} already holds a training log" in said, said
    assert "--dcp-overwrite-log" in said
    # --finetune starts at iteration 0: the log of the run it loads is not continued
    said = "\n".join(launcher_problems(_launcher_args(
        dcp_log_json=str(other), load=str(tmp_path / "their_ckpt"), finetune=True)))
    assert "already holds a training log" in said, said
    assert not launcher_problems(_launcher_args(dcp_log_json=str(other), dcp_overwrite_log=True))
    assert not launcher_problems(_launcher_args(dcp_log_json=str(other),
                                                load=str(tmp_path / "their_ckpt")))
    assert other.read_bytes() == before
    flags = add_launcher_args(argparse.ArgumentParser()).parse_args(["--dcp-overwrite-log"])
    assert flags.dcp_overwrite_log


# ------------------------------------------------------- case 2: a resume continues its log
def test_a_resumed_log_keeps_the_rows_up_to_the_loaded_iteration(tmp_path, capsys):
    """Before: a resume from iteration 2 appended 3, 4 after 1..4: [1, 2, 3, 4, 3, 4]."""
    ckpt, log = str(tmp_path / "ckpt"), tmp_path / "run.jsonl"
    _log(log, [1, 2, 3, 4], checkpoint_dir=os.path.realpath(ckpt))
    assert log_problem(str(log), flag="--log-json", overwrite_flag="--overwrite-log",
                       load_dir=ckpt) == ""  # this run's own: its rows name the --load folder
    _log(log, [3, 4], checkpoint_dir=os.path.realpath(ckpt), resume_at=2)
    assert _iterations(log) == [1, 2, 3, 4]
    err = capsys.readouterr().err
    assert f"--log-json {log}: resuming at iteration 2: kept 2 rows (up to iteration 2), " \
           "dropped 2 rows of later iterations; the log continues at iteration 3" in err, err
    # a log an earlier resume appended to, and a last row cut short by a crash: made monotone
    with open(log, "a") as f:
        f.write(log.read_text().splitlines(keepends=True)[2] + '{"iteration": 4, "lo')
    _log(log, [4], checkpoint_dir=os.path.realpath(ckpt), resume_at=3)
    assert _iterations(log) == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_megatron_example_resumed_continues_its_log_in_order(tmp_path):
    """Two real 2-rank runs: 4 iterations saved at 2 and 4, then a resume from iter_2 writing to
    the same log: its rows are 1, 2, 3, 4 (the resumed 3 and 4), not 1, 2, 3, 4, 3, 4."""
    log, ckpt = tmp_path / "run.jsonl", tmp_path / "ckpt"
    common = ["--train-iters", "4", "--global-batch-tokens", "768", "--seq-length", "256",
              "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
              "--quiet", "--log-json", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    runs = []
    for extra in (["--save", str(ckpt), "--save-interval", "2"],
                  ["--load", str(ckpt / "iter_2")]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", str(ROOT / "examples" / "pretrain_megatron.py"), *common, *extra]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append([json.loads(line) for line in log.read_text().splitlines()])
    assert [r["iteration"] for r in runs[1]] == [1, 2, 3, 4]
    assert runs[1][:2] == runs[0][:2]  # the rows up to the checkpoint are kept as they were
    assert "dropped 2 rows of later iterations" in done.stderr


# ------------------------------------------ case 3: a log that cannot be written, a TB file
@pytest.mark.parametrize("script", [*EXAMPLES, "launcher"])
def test_a_log_path_of_proc_is_refused_at_parse(script, capsys):
    """Before (as root, which os.access lets write anything): a traceback at the first row."""
    if not os.path.exists("/proc/version"):
        pytest.skip("no /proc")
    if script == "launcher":
        from megatron_dcp.megatron.lm import add_launcher_args

        parse, flag = add_launcher_args(argparse.ArgumentParser()).parse_args, "--dcp-log-json"
    else:
        parse, flag = _example(script).parse_args, "--log-json"
    with pytest.raises(SystemExit):
        parse([flag, "/proc/version"])
    err = capsys.readouterr().err
    assert f"argument {flag}: /proc/version: " in err, err


def test_a_tensorboard_dir_that_is_a_file_is_refused_naming_the_flag(tmp_path):
    """Before: TensorBoard's writer failed with FileExistsError when Megatron-LM made it."""
    from megatron_dcp.megatron.lm import launcher_problems

    notes = tmp_path / "notes"
    notes.write_text("mine\n")
    said = "\n".join(launcher_problems(_launcher_args(tensorboard_dir=str(notes))))
    assert f"--tensorboard-dir {notes} is a file: give a folder" in said, said
    said = "\n".join(launcher_problems(_launcher_args(tensorboard_dir=str(notes / "tb"))))
    assert f"lies under {notes}, which is a file" in said, said
    assert notes.read_text() == "mine\n"
    assert not [p for p in launcher_problems(_launcher_args(tensorboard_dir=str(tmp_path / "tb")))
                if "tensorboard" in p]


# ----------------------------------------------------- case 4: --save inside a checkpoint
def _run_folder(root: Path) -> Path:
    for step in (1, 2, 3):
        save_atomically(str(root), f"iter_{step}",
                        lambda tag: (root / tag).mkdir() or (root / tag / "w.pt").write_bytes(
                            b"weights") and {}, meta={"iteration": step})
    return root


@pytest.mark.parametrize("script", EXAMPLES)
@pytest.mark.parametrize("inside", ["iter_3", "iter_3/sub", "iter_2"])
def test_save_inside_another_runs_checkpoint_is_refused_at_parse(script, inside, tmp_path,
                                                                 capsys):
    """Before: ``--save RUN/iter_3`` wrote iter_1/, latest and scripts into that run's iter_3,
    whose next load refused it (unlisted files) and fell back to iter_2."""
    run = _run_folder(tmp_path / "run")
    before = _tree(run)
    with pytest.raises(SystemExit):
        _example(script).parse_args(["--save", str(run / inside)])
    err = capsys.readouterr().err
    kind = "is the checkpoint" if "/" not in inside else "lies inside the checkpoint"
    assert f"argument --save: checkpoint directory {run / inside} {kind} " \
           f"{run / inside.split('/')[0]} (it holds dcp_manifest.json)" in err, err
    assert f"--load {run} --save {run}" in err
    assert _tree(run) == before  # nothing created, nothing changed


def test_the_launchers_save_inside_a_megatron_checkpoint_is_refused(tmp_path):
    from megatron_dcp.megatron.lm import launcher_problems
    from megatron_dcp.megatron.lm_checkpoint import TRACKER, save_takeover_problem

    run = tmp_path / "run"
    (run / "iter_0000003" / "mp_rank_00").mkdir(parents=True)
    (run / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"weights")
    (run / TRACKER).write_text("3")
    before = _tree(run)
    for save in (run / "iter_0000003", run / "iter_0000003" / "mp_rank_00"):
        said = save_takeover_problem(str(save), None)
        assert f"--save {save} " in said and f"the checkpoint {run / 'iter_0000003'} " \
            f"(an iteration folder beside {run / TRACKER})" in said, said
    (run / "iter_0000003" / ".metadata").write_bytes(b"torch_dist")  # torch_dist's own mark
    said = "\n".join(launcher_problems(_launcher_args(save=str(run / "iter_0000003"),
                                                      load=str(run))))
    assert "is the checkpoint" in said and "(it holds .metadata)" in said, said
    (run / "iter_0000003" / ".metadata").unlink()
    assert _tree(run) == before
    assert save_takeover_problem(str(run), str(run)) == ""  # resuming that run: its own folder
