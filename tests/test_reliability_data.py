"""Reliability of datasets: a failed build leaves the previous dataset untouched, and opening a
corrupt index fails naming the file instead of feeding wrong tokens."""

import importlib.util
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_dcp.data import IndexedDataset, IndexedDatasetWriter
from megatron_dcp.data.indexed import HEADER_BYTES

ROOT = Path(__file__).resolve().parents[1]


def _build_tool():
    spec = importlib.util.spec_from_file_location("build_indexed_dataset",
                                                  ROOT / "tools" / "build_indexed_dataset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _jsonl(path: Path, count: int, bad_line: int = 0) -> Path:
    lines = [json.dumps({"text": f"document {i} " * (1 + i % 5)}) for i in range(count)]
    if bad_line:
        lines[bad_line - 1] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_failed_build_leaves_the_previous_dataset(tmp_path, capsys):
    build = _build_tool()
    prefix = tmp_path / "corpus"
    assert build(["--input", str(_jsonl(tmp_path / "a.jsonl", 400)),
                  "--output-prefix", str(prefix)]) == 0
    before = {s: (prefix.parent / (prefix.name + s)).read_bytes() for s in (".bin", ".idx")}
    # a build that fails on line 301 of its input: the 400-document dataset stays as it was
    bad = _jsonl(tmp_path / "b.jsonl", 400, bad_line=301)
    assert build(["--input", str(bad), "--output-prefix", str(prefix)]) == 1
    assert "b.jsonl:301" in capsys.readouterr().err
    for suffix, data in before.items():
        assert (prefix.parent / (prefix.name + suffix)).read_bytes() == data
    assert len(IndexedDataset(str(prefix))) == 400
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.jsonl", "corpus.bin", "corpus.idx"]
    # a missing input is an error before anything is written
    with pytest.raises(SystemExit):
        build(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix",
               str(tmp_path / "new")])
    assert "missing.jsonl" in capsys.readouterr().err
    assert not list(tmp_path.glob("new*"))


def test_writer_that_raises_writes_nothing(tmp_path):
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix) as writer:
        writer.add_document([1, 2, 3])
    with pytest.raises(RuntimeError, match="stop"):
        with IndexedDatasetWriter(prefix) as writer:
            writer.add_document([4, 5])
            raise RuntimeError("stop")
    np.testing.assert_array_equal(IndexedDataset(prefix)[0], [1, 2, 3])
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]


def _dataset(tmp_path, lengths=(5, 7, 9)) -> tuple[str, bytes]:
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for i, n in enumerate(lengths):
            writer.add_document(np.full(n, i))
    with open(prefix + ".idx", "rb") as f:
        return prefix, f.read()


def _write_idx(prefix: str, data: bytes) -> None:
    with open(prefix + ".idx", "wb") as f:
        f.write(data)


def test_corrupt_lengths_pointers_and_sizes_name_the_file(tmp_path):
    prefix, idx = _dataset(tmp_path)
    assert [len(IndexedDataset(prefix)[i]) for i in range(3)] == [5, 7, 9]
    # a middle length raised by 500 (formerly: 500 tokens of the next documents)
    raised = bytearray(idx)
    struct.pack_into("<i", raised, HEADER_BYTES + 4, 507)
    _write_idx(prefix, bytes(raised))
    with pytest.raises(ValueError, match=r"ds.idx: sequence 2 starts at byte 24, expected 1024"):
        IndexedDataset(prefix)
    # a pointer moved
    moved = bytearray(idx)
    struct.pack_into("<q", moved, HEADER_BYTES + 3 * 4 + 8, 12)
    _write_idx(prefix, bytes(moved))
    with pytest.raises(ValueError, match="ds.idx: sequence 1 starts at byte 12, expected 10"):
        IndexedDataset(prefix)
    # a negative length
    negative = bytearray(idx)
    struct.pack_into("<i", negative, HEADER_BYTES, -1)
    _write_idx(prefix, bytes(negative))
    with pytest.raises(ValueError, match="sequence 0 has a negative length"):
        IndexedDataset(prefix)
    # a truncated .idx (formerly: numpy's "buffer is smaller than requested size")
    for cut in (len(idx) - 8, 12):
        _write_idx(prefix, idx[:cut])
        with pytest.raises(ValueError, match=r"ds.idx is truncated"):
            IndexedDataset(prefix)
    # document indices that do not end at the sequence count
    docs = bytearray(idx)
    struct.pack_into("<q", docs, len(idx) - 8, 2)
    _write_idx(prefix, bytes(docs))
    with pytest.raises(ValueError, match="document indices must run from 0 to the sequence"):
        IndexedDataset(prefix)
    # a .bin shorter or longer than the index says
    _write_idx(prefix, idx)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(40)
    with pytest.raises(ValueError, match=r"ds.bin has 40 bytes, its index .*ds.idx describes 42"):
        IndexedDataset(prefix)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0" * 4)
    with pytest.raises(ValueError, match="ds.bin has 44 bytes"):
        IndexedDataset(prefix)


def test_validation_spans_chunks(tmp_path, monkeypatch):
    from megatron_dcp.data import indexed

    monkeypatch.setattr(indexed, "_CHECK_CHUNK", 2)  # the carry between vectorised passes
    prefix, idx = _dataset(tmp_path, lengths=(3, 1, 4, 1, 5))
    assert [len(x) for x in (IndexedDataset(prefix)[i] for i in range(5))] == [3, 1, 4, 1, 5]
    broken = bytearray(idx)
    struct.pack_into("<i", broken, HEADER_BYTES + 2 * 4, 6)  # sequence 2: 4 -> 6 tokens
    _write_idx(prefix, bytes(broken))
    with pytest.raises(ValueError, match="sequence 3 starts at byte 16, expected 20"):
        IndexedDataset(prefix)
