"""Loads run no code (issue 31): every pickle a checkpoint load reads admits only the classes its
format needs. A crafted file whose unpickling would create a marker file is refused, naming the
file and the class, and the marker never appears. Each crafted case is first shown to run its
code through the reader torch or megatron-core would use (so the test fails without the fix).

Unit cases (one process): torch.distributed.checkpoint's ``.metadata`` (read by torch with a
plain ``pickle.load``) and a byte item inside a ``.distcp`` file (unpickled by torch's default
planner with ``weights_only=False``), both through `SafeFileSystemReader`; a ``torch.save`` file
through `load_weights`."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo

from megatron_dcp.runtime.safe_load import (SafeFileSystemReader, UnsafeCheckpointError,
                                            load_weights, read_pickle)


class Payload:
    """Unpickling this creates the file ``marker`` (``open(marker, "w")``): code from the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _saved(tmp_path) -> tuple[str, dict]:
    """A torch.distributed.checkpoint directory (one process) with a tensor and a byte item."""
    state = {"w": torch.arange(6.0).view(2, 3), "extra": io.BytesIO(b"x")}
    path = str(tmp_path / "ckpt")
    torch.save({"plain": 1}, state["extra"])
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path, state


def _target() -> dict:
    return {"w": torch.zeros(2, 3), "extra": io.BytesIO()}


def test_a_good_checkpoint_loads_through_the_safe_reader(tmp_path):
    path, _ = _saved(tmp_path)
    target = _target()
    dcp.load(target, storage_reader=SafeFileSystemReader(path), no_dist=True)
    assert torch.equal(target["w"], torch.arange(6.0).view(2, 3))


def test_crafted_metadata_runs_nothing_and_names_file_and_class(tmp_path):
    path, _ = _saved(tmp_path)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as handle:
        metadata = pickle.load(handle)
    marker = tmp_path / "ran"
    metadata.planner_data = Payload(str(marker))  # a field torch never looks at
    with open(meta, "wb") as handle:
        pickle.dump(metadata, handle)

    # torch wraps what the reader raised into its CheckpointException (a BaseException)
    with pytest.raises(BaseException, match=r"\.metadata asks for \w+\.open"):
        dcp.load(_target(), storage_reader=SafeFileSystemReader(path), no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match=r"\w+\.open"):
        read_pickle(meta)
    assert not marker.exists()
    FileSystemReader(path).read_metadata()  # torch's own reader runs the file's code
    assert marker.exists()


def test_crafted_byte_item_runs_nothing(tmp_path):
    path, _ = _saved(tmp_path)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as handle:
        metadata = pickle.load(handle)
    marker = tmp_path / "ran"
    payload = io.BytesIO()
    torch.save({"plain": Payload(str(marker))}, payload)
    (index, info), = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == "extra"]
    data_file = os.path.join(path, info.relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as handle:  # the crafted item appended, the metadata pointed at it
        handle.write(payload.getvalue())
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset,
                                                len(payload.getvalue()))
    with open(meta, "wb") as handle:
        pickle.dump(metadata, handle)

    with pytest.raises(BaseException, match=r"item extra\).*\w+\.open"):
        dcp.load(_target(), storage_reader=SafeFileSystemReader(path), no_dist=True)
    assert not marker.exists()
    dcp.load(_target(), storage_reader=FileSystemReader(path), no_dist=True)
    assert marker.exists()  # torch's default planner unpickles the item fully


def test_crafted_torch_save_file_is_refused_naming_it(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "state.pt"
    torch.save({"iteration": 3, "extra": Payload(str(marker))}, path)
    with pytest.raises(UnsafeCheckpointError, match=f"{path} .*asks for \\w+.open"):
        load_weights(str(path))
    assert not marker.exists()
    torch.save({"iteration": 3, "t": torch.ones(2)}, path)
    assert load_weights(str(path))["iteration"] == 3


# ------------------------------------------------- the Megatron example, --ckpt-format torch_dist
ROOT = Path(__file__).resolve().parents[1]
MEGATRON = ROOT / "examples" / "pretrain_megatron.py"
SMALL = ["--calculate-per-token-loss", "--global-batch-tokens", "1024", "--seq-length", "256",
         "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--dcp",
         "--quiet", "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "1"]


def _megatron(flags: list[str], ranks: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(ranks), str(MEGATRON), *SMALL, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)


def _reseal(checkpoint: Path) -> None:
    """Record the files' current sizes and checksums in the manifest, as whoever crafted them
    would: the integrity check passes, only the restricted unpickling stops them."""
    from megatron_dcp.runtime.checkpoint_dir import MANIFEST, file_checksum

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name in manifest["files"]:
        manifest["files"][name] = (checkpoint / name).stat().st_size
        manifest["checksums"][name] = file_checksum(str(checkpoint / name))
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _craft_metadata(path: Path, marker: Path) -> None:
    with open(path, "rb") as handle:
        metadata = pickle.load(handle)
    metadata.planner_data = Payload(str(marker))
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)


def _craft_torch_save(path: Path, marker: Path) -> None:
    state = torch.load(path, weights_only=True)
    state["extra" if "extra" in state else "optimizer"] = Payload(str(marker))
    torch.save(state, path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_crafted_torch_dist_files_run_nothing_and_stop_before_training(tmp_path):
    ckpt = tmp_path / "ckpt"
    done = _megatron(["--train-iters", "2", "--save", str(ckpt)])
    assert done.returncode == 0, done.stderr[-3000:]
    tag = ckpt / "iter_2"
    # megatron-core 0.19 writes no common.pt: its common state is a byte item of the torch_dist
    # files, read through the same checked reader as .metadata's items
    for name, craft in ((".metadata", _craft_metadata), ("common.pt", _craft_torch_save),
                        ("state.pt", _craft_torch_save)):
        if name == "common.pt" and not (tag / name).exists():
            continue
        original, marker = (tag / name).read_bytes(), tmp_path / f"ran{name}"
        craft(tag / name, marker)
        _reseal(tag)
        log = tmp_path / f"{name}.jsonl"
        done = _megatron(["--train-iters", "3", "--load", str(ckpt), "--log-json", str(log)])
        assert done.returncode != 0 and not marker.exists(), name
        assert f"{tag / name} " in done.stderr and "open" in done.stderr, done.stderr[-3000:]
        assert not log.exists() or not log.read_text().strip()  # stopped before training
        (tag / name).write_bytes(original)
        _reseal(tag)
    done = _megatron(["--train-iters", "3", "--load", str(ckpt)])  # restored: loads again
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tensor_parallel_change_of_the_padded_vocabulary_is_refused_both_ways(tmp_path):
    """DP 2 (vocabulary padded to 384) <-> TP 2 (512), without the distributed optimizer:
    megatron-core would load the overlapping rows and keep the rest random; refused at start
    naming the padding and the flag that makes it fit."""
    for saved, resumed, rows, hint in ((["--tensor-model-parallel-size", "1"],
                                        ["--tensor-model-parallel-size", "2"], (384, 512), 192),
                                       (["--tensor-model-parallel-size", "2"],
                                        ["--tensor-model-parallel-size", "1"], (512, 384), 512)):
        ckpt = tmp_path / f"tp{saved[-1]}"
        done = _megatron(["--train-iters", "1", "--save", str(ckpt), *saved], ranks=2)
        assert done.returncode == 0, done.stderr[-3000:]
        done = _megatron(["--train-iters", "2", "--load", str(ckpt), *resumed], ranks=2)
        assert done.returncode != 0
        assert (f"the padded vocabulary differs ({rows[0]} rows saved, {rows[1]} here)"
                in done.stderr), done.stderr[-3000:]
        assert f"resume with --make-vocab-size-divisible-by {hint}" in done.stderr
        done = _megatron(["--train-iters", "2", "--load", str(ckpt), *resumed,
                          "--make-vocab-size-divisible-by", str(hint)], ranks=2)
        assert done.returncode == 0, done.stderr[-3000:]
