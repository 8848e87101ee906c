"""Every folder Megatron-LM's loaders read goes through the launcher's load gate (issue 59):
`load_sources` against Megatron-LM 0.19's own ``load_checkpoint`` and
``load_args_from_checkpoint`` on prepared directories (its choice between ``--load``,
``--pretrained-checkpoint``, ``--ckpt-step``, ``release`` and newer ``--non-persistent-ckpt-type
global`` checkpoints, recorded where it starts reading), then a crafted ``.metadata`` in the
folder chosen: refused naming the flag and the file, and nothing runs."""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training", reason="Megatron-LM's training package (megatron-core "
                    "0.19, Python 3.12: the .venv312 leg of make test)")

from megatron_dcp.megatron.lm_checkpoint import (LoadSource, base_sources,  # noqa: E402
                                                 check_sources, load_sources,
                                                 non_persistent_local_problem)
from megatron_dcp.runtime.checkpoint_dir import CheckpointError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_megatron_lm_checkpoints import _Payload  # noqa: E402


class _Read(Exception):
    """Megatron-LM started reading this checkpoint folder."""


def _folder(root: Path, name: str) -> Path:
    """A torch_dist checkpoint folder as megatron-core recognises one (its ``metadata.json``)."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                      "sharded_backend_version": 1}))
    return folder


def _run(root: Path, iterations: tuple = (), tracker: object = None) -> Path:
    """A ``--save`` directory with ``iter_*`` folders and a tracker naming ``tracker``."""
    root.mkdir(parents=True, exist_ok=True)
    for it in iterations:
        _folder(root, "release" if it == "release" else f"iter_{it:07d}")
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(str(tracker))
    return root


def _args(**given) -> argparse.Namespace:
    args = dict(load=None, pretrained_checkpoint=None, ckpt_step=None, finetune=False,
                non_persistent_ckpt_type=None, non_persistent_global_ckpt_dir=None,
                ckpt_format="torch_dist", auto_detect_ckpt_format=False,
                exit_on_missing_checkpoint=False, use_dist_ckpt=True, dcp=True)
    args.update(given)
    return argparse.Namespace(**args)


def _megatron_reads(monkeypatch, args: argparse.Namespace, load_args: str = "") -> list[str]:
    """The folders Megatron-LM's own ``load_checkpoint`` (or ``load_args_from_checkpoint(args,
    load_args)``) starts reading with ``args``: every torch_dist read, persistent or
    non-persistent, goes through ``_load_global_dist_base_checkpoint``."""
    from megatron.training import checkpointing

    def record(load_dir, args, rank0, sharded_state_dict, iteration, release, **_):
        raise _Read(checkpointing.get_checkpoint_name(load_dir, iteration, release,
                                                      return_base_dir=True))

    monkeypatch.setattr(checkpointing, "_load_global_dist_base_checkpoint", record)
    monkeypatch.setattr(checkpointing, "get_args", lambda: args)
    try:
        if load_args:
            checkpointing.load_args_from_checkpoint(args, load_args)
        else:
            checkpointing.load_checkpoint([], None, None)
    except _Read as read:
        return [str(read)]
    except FileNotFoundError:  # --pretrained-checkpoint without a tracker: nothing read
        return []
    return []


def _cases(tmp: Path) -> dict:
    """name -> (args, the flag Megatron-LM's choice is named by, or None when it reads
    nothing)."""
    run, other, empty = tmp / "run", tmp / "pre", tmp / "empty"
    _run(run, (2, 4), tracker=4)
    _run(other, (3,), tracker=3)
    empty.mkdir()
    _run(tmp / "rel", ("release",), tracker="release")
    _run(tmp / "np", (2,), tracker=2)
    _run(tmp / "np" / "non_persistent", (5,), tracker=5)
    _run(tmp / "old_np", (6,), tracker=6)
    _run(tmp / "old_np" / "non_persistent", (5,), tracker=5)
    _run(tmp / "global", (7,), tracker=7)
    _run(tmp / "pre_np", (3,), tracker=3)
    _run(tmp / "pre_np" / "non_persistent", (4,), tracker=4)
    _run(tmp / "bare", (2,))  # iteration folders, no tracker
    glob = "--non-persistent-ckpt-type global"
    return {
        "load": (_args(load=str(run)), "--load"),
        "ckpt-step": (_args(load=str(run), ckpt_step=2), "--load"),
        "ckpt-step without tracker": (_args(load=str(tmp / "bare"), ckpt_step=2), "--load"),
        "release": (_args(load=str(tmp / "rel")), "--load"),
        "no checkpoint": (_args(load=str(empty)), None),
        "pretrained, empty load": (_args(load=str(empty), pretrained_checkpoint=str(other)),
                                   "--pretrained-checkpoint"),
        "pretrained alone": (_args(pretrained_checkpoint=str(other)), "--pretrained-checkpoint"),
        "pretrained and finetune": (_args(pretrained_checkpoint=str(other), finetune=True),
                                    "--pretrained-checkpoint"),
        "pretrained, ckpt-step": (_args(pretrained_checkpoint=str(tmp / "run"), ckpt_step=2),
                                  "--pretrained-checkpoint"),
        "load wins over pretrained": (_args(load=str(run), pretrained_checkpoint=str(other)),
                                      "--load"),
        "pretrained without tracker": (_args(load=str(empty), pretrained_checkpoint=str(empty)),
                                       None),
        "non-persistent newer": (_args(load=str(tmp / "np"), non_persistent_ckpt_type="global"),
                                 glob),
        "non-persistent older": (_args(load=str(tmp / "old_np"),
                                       non_persistent_ckpt_type="global"), "--load"),
        "non-persistent, ckpt-step": (_args(load=str(tmp / "old_np"), ckpt_step=2,
                                            non_persistent_ckpt_type="global"), glob),
        "non-persistent dir": (_args(load=str(run), non_persistent_ckpt_type="global",
                                     non_persistent_global_ckpt_dir=str(tmp / "global")), glob),
        "non-persistent dir, no load": (_args(non_persistent_ckpt_type="global",
                                              non_persistent_global_ckpt_dir=str(tmp / "global")),
                                        glob),
        "non-persistent dir, pretrained without tracker": (
            _args(non_persistent_ckpt_type="global", pretrained_checkpoint=str(empty),
                  non_persistent_global_ckpt_dir=str(tmp / "global")), None),
        "non-persistent of pretrained": (_args(load=str(empty), non_persistent_ckpt_type="global",
                                               pretrained_checkpoint=str(tmp / "pre_np")), glob),
        "non-persistent without the type": (_args(load=str(tmp / "np")), "--load"),
    }


def _names() -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return list(_cases(Path(tmp)))


@pytest.mark.parametrize("name", _names())
def test_every_folder_megatron_lm_loads_is_gated(tmp_path, monkeypatch, name):
    """The folder `load_sources` names is the one Megatron-LM's ``load_checkpoint`` reads (none
    where it reads none), and a crafted ``.metadata`` there is refused naming the flag and the
    file before anything is unpickled."""
    args, flag = _cases(tmp_path)[name]
    sources = load_sources(args)
    assert [s.folder for s in sources] == _megatron_reads(monkeypatch, args), name
    if flag is None:
        assert sources == []
        return
    assert sources[0].flag.startswith(flag), sources
    marker = tmp_path / "ran"
    crafted = Path(sources[0].folder) / ".metadata"
    crafted.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError) as err:
        check_sources(sources)
    assert not marker.exists()
    assert str(err.value).startswith(flag) and f"{crafted} asks for posix.system" in str(err.value)


@pytest.mark.parametrize("name", ["load", "ckpt-step", "release", "pretrained alone",
                                  "non-persistent newer", "non-persistent of pretrained"])
def test_use_checkpoint_args_reads_what_the_gate_checked(tmp_path, monkeypatch, name):
    """``--use-checkpoint-args``: Megatron-LM's ``load_args_from_checkpoint`` for
    ``--pretrained-checkpoint`` and for ``--load`` reads the folder `base_sources` names (what
    `megatron_dcp.megatron.lm_checkpoint.gated_load_args` checks first)."""
    args, _ = _cases(tmp_path)[name]
    for load_arg in ("pretrained_checkpoint", "load"):
        where = getattr(args, load_arg)
        mine = base_sources(where, "--x", args) if where is not None else []
        assert [s.folder for s in mine] == _megatron_reads(monkeypatch, args, load_arg), \
            (name, load_arg)


def test_the_gated_load_args_refuses_a_crafted_pretrained_checkpoint(tmp_path):
    from megatron_dcp.megatron.lm_checkpoint import gated_load_args

    args, _ = _cases(tmp_path)["pretrained alone"]
    marker = tmp_path / "ran"
    crafted = tmp_path / "pre" / "iter_0000003" / ".metadata"
    crafted.write_bytes(pickle.dumps(_Payload(marker)))
    gated = gated_load_args(lambda *a, **k: pytest.fail("Megatron-LM read the checkpoint"))
    with pytest.raises(CheckpointError, match=f"--pretrained-checkpoint .*{crafted} asks for"):
        gated(args, load_arg="pretrained_checkpoint")
    assert not marker.exists()


def test_local_non_persistent_checkpoints_are_refused_under_dcp():
    """nvidia-resiliency-ext's local checkpoints are read by its own manager, which the gate
    cannot check first: refused at start, naming the flag and the alternative."""
    assert "--non-persistent-ckpt-type local" in non_persistent_local_problem(
        _args(non_persistent_ckpt_type="local"))
    assert "use --non-persistent-ckpt-type global" in non_persistent_local_problem(
        _args(non_persistent_ckpt_type="local"))
    assert non_persistent_local_problem(_args(non_persistent_ckpt_type="global")) == ""


def test_fsdp_dtensor_also_reads_the_load_folders_metadata(tmp_path):
    """With ``--ckpt-format fsdp_dtensor`` Megatron-LM also reads the ``.metadata`` of the
    ``--load`` folder (``get_load_checkpoint_path_by_args``), whichever folder it loads."""
    args, _ = _cases(tmp_path)["non-persistent dir"]
    args.ckpt_format = "fsdp_dtensor"
    assert load_sources(args) == [
        LoadSource(f"--non-persistent-ckpt-type global ({tmp_path / 'global'})",
                   str(tmp_path / "global" / "iter_0000007")),
        LoadSource(f"--load {tmp_path / 'run'}", str(tmp_path / "run" / "iter_0000004"))]


@pytest.mark.slow  # launches Megatron-LM four times
@pytest.mark.timeout(900)
def test_the_launcher_gates_pretrained_and_non_persistent_checkpoints(tmp_path):
    """Issue 59: through the launcher under --dcp, a TP-1 checkpoint given as
    ``--pretrained-checkpoint`` with an empty ``--load`` at TP 2 (384 padded rows, 512 here)
    trained another model with status 0; a crafted ``.metadata`` as ``--pretrained-checkpoint``
    or in a newer ``--non-persistent-ckpt-type global`` checkpoint of ``--load`` ran its code.
    Each is refused on every rank before Megatron-LM reads it, naming the flag and the file."""
    import shutil

    from test_megatron_launcher import _launch, _lm_losses

    run = ["--dcp", "--ckpt-format", "torch_dist", "--vocab-size", "257"]
    base, empty, marker = tmp_path / "base", tmp_path / "empty", tmp_path / "ran"
    _lm_losses(_launch(run + ["--save", str(base), "--save-interval", "2", "--exit-interval",
                              "2"], ranks=1))
    empty.mkdir()
    done = _launch(run + ["--pretrained-checkpoint", str(base), "--load", str(empty),
                          "--tensor-model-parallel-size", "2", "--exit-interval", "3"])
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "iteration        3/" not in out, out[-3000:]
    assert f"--pretrained-checkpoint {base}: checkpoint {base}/iter_0000002 holds tensors of " \
        "another shape" in out and "(384 rows saved, 512 here)" in out, out[-6000:]

    pre = tmp_path / "pre"
    shutil.copytree(base, pre)
    (pre / "iter_0000002" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    done = _launch(run + ["--pretrained-checkpoint", str(pre), "--exit-interval", "3"], ranks=1)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and not marker.exists(), out[-3000:]
    assert f"--pretrained-checkpoint {pre}: {pre}/iter_0000002/.metadata asks for posix.system" \
        in out, out[-6000:]

    newer = base / "non_persistent" / "iter_0000003"
    shutil.copytree(base / "iter_0000002", newer)
    (base / "non_persistent" / "latest_checkpointed_iteration.txt").write_text("3")
    (newer / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    done = _launch(run + ["--load", str(base), "--non-persistent-ckpt-type", "global",
                          "--exit-interval", "3"], ranks=1)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and not marker.exists(), out[-3000:]
    assert f"--non-persistent-ckpt-type global ({base}/non_persistent): {newer}/.metadata " \
        "asks for posix.system" in out, out[-6000:]


def test_the_launcher_refuses_local_non_persistent_checkpoints_before_megatron_lm():
    """The refusal comes before Megatron-LM's own ``validate_args`` (which asks for
    nvidia-resiliency-ext without naming --dcp's reason)."""
    from megatron_dcp.megatron.args import DCPArgumentError
    from megatron_dcp.megatron.lm import _validate_args

    check = _validate_args(lambda args: pytest.fail("Megatron-LM's validate_args ran"))
    with pytest.raises(DCPArgumentError, match="--non-persistent-ckpt-type local: DCP's load"):
        check(_args(non_persistent_ckpt_type="local"))


def test_the_planner_state_goes_where_the_load_finds_it(tmp_path):
    """``dcp_planner.json`` is written into the folder Megatron-LM's ``save_checkpoint`` wrote,
    a global non-persistent save's included (not a stray ``--save``/``iter_N`` holding only
    it), and the load reads it from the folder `load_sources` names."""
    from megatron_dcp.megatron.lm_checkpoint import _saved_folder

    save = tmp_path / "run"
    args = _args(save=str(save), load=str(save), non_persistent_ckpt_type="global")
    assert _saved_folder(args, 3) == str(save / "iter_0000003")
    assert _saved_folder(args, 5, non_persistent_ckpt=True) == \
        str(save / "non_persistent" / "iter_0000005")
    _run(save, (3,), tracker=3)
    _run(save / "non_persistent", (5,), tracker=5)
    assert load_sources(args)[0].folder == _saved_folder(args, 5, non_persistent_ckpt=True)
    given = _args(save=str(save), non_persistent_ckpt_type="global",
                  non_persistent_global_ckpt_dir=str(tmp_path / "np"))
    assert _saved_folder(given, 5, non_persistent_ckpt=True) == str(tmp_path / "np" /
                                                                     "iter_0000005")
    assert _saved_folder(_args(save=str(save), non_persistent_ckpt_type="local"), 5,
                         non_persistent_ckpt=True) is None
    assert _saved_folder(_args(save=None), 5) is None
