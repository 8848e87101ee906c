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
import os
import pickle

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
