"""Megatron-LM's checkpoints through the launcher under ``--dcp`` (issue 48, items 1 and 8):
nothing in a file runs on ``--load`` (a crafted ``.metadata``, byte item or ``.pt`` is refused
before Megatron-LM reads it; Megatron-LM's own checkpoints load), and ``--save`` into another
run's checkpoints is refused at start."""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.training", reason="Megatron-LM's training package (megatron-core "
                    "0.19, Python 3.12: the .venv312 leg of make test)")

from megatron_dcp.megatron.lm_checkpoint import (check_sources, load_sources,  # noqa: E402
                                                 megatron_lm_globals, save_takeover_problem)
from megatron_dcp.runtime.checkpoint_dir import CheckpointError  # noqa: E402
from megatron_dcp.runtime.safe_load import check_folder  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


class _Payload:
    """Unpickling it creates the marker file: what a crafted checkpoint file does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _iteration(root: Path, it: int = 2) -> Path:
    folder = root / f"iter_{it:07d}"
    folder.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(it))
    return folder


def check_load(root: str) -> None:
    """The launcher's gate of ``--load root`` (no process group: this process alone)."""
    check_sources(load_sources(argparse.Namespace(load=root, ckpt_format="torch_dist")))


def _megatron_like(folder: Path, extra: object = None) -> None:
    """A torch.distributed.checkpoint folder holding what Megatron-LM's torch_dist saves beside
    tensors: its arguments, a megatron-core enum, a numpy RNG state."""
    import numpy as np
    import torch.distributed.checkpoint as dcp
    from megatron.core.transformer.enums import AttnBackend

    state = {"w": torch.ones(4), "args": argparse.Namespace(lr=1e-3, backend=AttnBackend.auto),
             "rng": np.random.RandomState(0).get_state()}
    if extra is not None:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def test_megatron_lm_checkpoint_contents_are_admitted(tmp_path):
    folder = _iteration(tmp_path)
    _megatron_like(folder)
    torch.save({"args": argparse.Namespace(x=1), "w": torch.ones(2)}, folder / "model_optim_rng.pt")
    assert [s.folder for s in load_sources(argparse.Namespace(load=str(tmp_path)))] == \
        [str(folder)]
    assert sorted(os.path.basename(p) for p in check_folder(str(folder), megatron_lm_globals)) \
        == [".metadata", "model_optim_rng.pt"]
    check_load(str(tmp_path))


def test_admitted_globals_are_megatrons_not_callables():
    admitted = megatron_lm_globals(["argparse.Namespace", "numpy.ndarray", "posix.system",
                                    "megatron.core.transformer.enums.AttnBackend",
                                    "megatron.core.transformer.transformer_config."
                                    "TransformerConfig", "shutil.rmtree", "builtins.eval"])
    assert [getattr(a, "__name__", "") for a in admitted] == ["Namespace", "ndarray",
                                                              "AttnBackend"]


@pytest.mark.parametrize("where", [".metadata", "byte item", ".pt"])
def test_a_crafted_file_is_refused_and_nothing_runs(tmp_path, where):
    marker = tmp_path / "ran"
    folder = _iteration(tmp_path / "ckpt")
    _megatron_like(folder, extra=_Payload(marker) if where == "byte item" else None)
    if where == ".metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    if where == ".pt":
        torch.save({"model": _Payload(marker)}, folder / "model_optim_rng.pt")
    with pytest.raises(CheckpointError, match="system") as err:
        check_load(str(tmp_path / "ckpt"))
    assert not marker.exists() and "--load" in str(err.value)
    assert (".metadata" if where != ".pt" else "model_optim_rng.pt") in str(err.value)


def test_a_metadata_that_is_no_pickle_is_refused_like_a_crafted_one(tmp_path):
    folder = _iteration(tmp_path / "ckpt")
    _megatron_like(folder)
    (folder / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="--load .*not a readable pickle"):
        check_load(str(tmp_path / "ckpt"))


def test_save_into_another_runs_checkpoints_is_refused(tmp_path):
    other = tmp_path / "other"
    _iteration(other, 3)
    assert "holds another run's checkpoints (iterations 3" in save_takeover_problem(
        str(other), None)
    assert "another run's" in save_takeover_problem(str(other), str(tmp_path / "mine"))
    assert save_takeover_problem(str(other), str(other)) == ""  # resuming it
    assert "--ckpt-step 2 resumes an older" in save_takeover_problem(str(other), str(other), 2)
    assert save_takeover_problem(str(tmp_path / "fresh"), None) == ""
    (tmp_path / "empty").mkdir()
    assert save_takeover_problem(str(tmp_path / "empty"), None) == ""


@pytest.mark.slow  # launches Megatron-LM
@pytest.mark.timeout(600)
def test_the_launcher_refuses_a_crafted_metadata_and_another_runs_save_dir(tmp_path):
    """Megatron-LM's own torch_dist checkpoint, saved and loaded through the launcher under
    --dcp; its .metadata replaced by a crafted pickle: the --load stops on every rank with the
    file named, the payload never ran (it did before: Megatron-LM's reader unpickles it). A
    --save into that directory without --load is refused at start."""
    from test_megatron_launcher import _budget_gb, _launch, _lm_losses

    run = ["--dcp", "--dcp-hardware", "h200", "--dcp-pack-tokens", "128",
           "--dcp-memory-budget-gb", f"{_budget_gb(200):.6f}", "--ckpt-format", "torch_dist"]
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    _lm_losses(_launch(run + ["--save", str(ckpt), "--save-interval", "2", "--exit-interval",
                              "2"]))
    _lm_losses(_launch(run + ["--load", str(ckpt), "--exit-interval", "3"]))  # admitted
    (ckpt / "iter_0000002" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    done = _launch(run + ["--load", str(ckpt)])
    out = done.stdout + done.stderr
    assert done.returncode != 0 and not marker.exists(), out[-3000:]
    assert "iter_0000002/.metadata asks for posix.system" in out, out[-9000:]
    taken = _launch(run + ["--save", str(ckpt), "--save-interval", "2"], ranks=1)
    out = taken.stdout + taken.stderr
    assert taken.returncode != 0 and "holds another run's checkpoints" in out, out[-3000:]
    assert "iteration        1/" not in out


@pytest.mark.slow  # launches Megatron-LM
@pytest.mark.timeout(600)
def test_the_launcher_refuses_a_padded_vocabulary_change_and_names_the_flag(tmp_path):
    """Issue 48, item 3: a torch_dist checkpoint saved at TP 1 (a 257-token vocabulary padded
    to 384 rows) loaded at TP 2 (512 rows): megatron-core would load 384 rows and keep the rest
    random (status 0, another model). Refused on every rank before the load, naming the rows and
    the --make-vocab-size-divisible-by that pads to the saved size; with that flag it loads."""
    from test_megatron_launcher import _launch, _lm_losses

    run = ["--dcp", "--ckpt-format", "torch_dist", "--vocab-size", "257"]
    ckpt = tmp_path / "ckpt"
    _lm_losses(_launch(run + ["--save", str(ckpt), "--save-interval", "2", "--exit-interval",
                              "2"]))
    tp2 = run + ["--load", str(ckpt), "--tensor-model-parallel-size", "2", "--exit-interval",
                 "3"]
    done = _launch(tp2)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert "the padded vocabulary differs (384 rows saved, 512 here)" in out, out[-6000:]
    assert "resume with --make-vocab-size-divisible-by 192" in out, out[-6000:]
    assert "iteration        3/" not in out
    _lm_losses(_launch(tp2 + ["--make-vocab-size-divisible-by", "192"]))


@pytest.mark.slow  # launches Megatron-LM
@pytest.mark.timeout(300)
def test_a_load_megatron_lm_gives_up_on_exits_non_zero(tmp_path):
    """Issue 48, item 5: Megatron-LM's ``load_checkpoint`` ends with ``sys.exit()`` (status 0)
    on a checkpoint it cannot load, here a tracker file naming no iteration; a resume script saw
    success. Under ``--dcp`` the status is 1 and nothing trained."""
    from test_megatron_launcher import _launch

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("not-an-iteration\n")
    done = _launch(["--dcp", "--ckpt-format", "torch_dist", "--load", str(ckpt)], ranks=1,
                   timeout=200)
    out = done.stdout + done.stderr
    assert "Invalid metadata file" in out, out[-3000:]
    assert done.returncode != 0 and "stopped with status 1" in out, out[-3000:]
    assert "iteration        1/" not in out
