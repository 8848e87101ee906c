"""Reliability of datasets: a failed build leaves the previous dataset untouched, and opening a
corrupt index fails naming the file instead of feeding wrong tokens."""

import importlib.util
import json
import os
import struct
import sys
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
    assert build(["--input", str(bad), "--output-prefix", str(prefix), "--overwrite"]) == 1
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


def test_build_refuses_to_replace_a_dataset_without_overwrite(tmp_path, capsys):
    build = _build_tool()
    prefix = tmp_path / "corpus"
    assert build(["--input", str(_jsonl(tmp_path / "a.jsonl", 400)),
                  "--output-prefix", str(prefix)]) == 0
    before = {s: (tmp_path / ("corpus" + s)).read_bytes() for s in (".bin", ".idx")}
    small = _jsonl(tmp_path / "b.jsonl", 6)
    with pytest.raises(SystemExit) as exit_info:
        build(["--input", str(small), "--output-prefix", str(prefix)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "already exist" in err and "--overwrite" in err
    for suffix, data in before.items():
        assert (tmp_path / ("corpus" + suffix)).read_bytes() == data
    assert len(IndexedDataset(str(prefix))) == 400
    assert build(["--input", str(small), "--output-prefix", str(prefix), "--overwrite"]) == 0
    assert len(IndexedDataset(str(prefix))) == 6
    # a prefix under a file: named as such, not "File exists"
    with pytest.raises(SystemExit):
        build(["--input", str(small), "--output-prefix", str(tmp_path / "a.jsonl" / "x")])
    assert "a.jsonl' is a file" in capsys.readouterr().err


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


# ------------------------------------------------------------------ issue 22: clear or refused
def test_non_utf8_jsonl_line_names_file_and_line(tmp_path, capsys):
    from megatron_dcp.data import read_documents

    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not UTF-8 text \(byte 0xe9"):
        list(read_documents(str(path)))
    text = tmp_path / "bad.txt"
    text.write_bytes(b"para one\n\n\xff\xfe para two\n")
    with pytest.raises(ValueError, match=r"bad.txt:3: not UTF-8"):
        list(read_documents(str(text)))
    assert _build_tool()(["--input", str(path), "--output-prefix", str(tmp_path / "x")]) == 1
    assert "bad.jsonl:2: not UTF-8" in capsys.readouterr().err


def test_empty_dataset_build_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    prefix = tmp_path / "out"
    assert _build_tool()(["--input", str(empty), "--output-prefix", str(prefix)]) == 1
    assert "no documents in" in capsys.readouterr().err
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()


def test_token_id_past_the_vocabulary_names_the_document(tmp_path):
    from megatron_dcp.data import open_dataset

    prefix = str(tmp_path / "ids")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in ([1, 2, 3], [4, 5], [6, 300, 7, 8]):
            w.add_document(doc)
    open_dataset(prefix, vocab_size=301)  # every id fits
    with pytest.raises(ValueError, match=r"document 2 has token id 300 at position 1, outside "
                                         r"the model's vocabulary of 257"):
        open_dataset(prefix, vocab_size=257)


def test_megatron_example_checks_ids_against_the_real_vocabulary(tmp_path):
    """Issue 31: id 300 is below the padded vocabulary (384) but no byte token."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import pretrain_megatron
    finally:
        sys.path.remove(str(ROOT / "examples"))
    prefix = str(tmp_path / "ids")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in ([1, 2, 3], [6, 300, 7, 8]):
            w.add_document(doc)
    args = pretrain_megatron.parse_args(["--data-path", prefix])
    assert pretrain_megatron.padded_vocab_size(args) == 384
    with pytest.raises(ValueError, match=r"document 1 has token id 300 .*vocabulary of 257"):
        pretrain_megatron.open_training_data(args)


def test_batch_larger_than_the_corpus_is_refused_at_once():
    import time

    from megatron_dcp.data import GlobalBatchSampler

    lengths = [100, 300, 50]
    GlobalBatchSampler(lengths, 350, max_seq_len=200)  # 100 + 200 (cut) + 50: exactly fits
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"global batch of 100000000 tokens needs more than the "
                                         r"corpus holds: 350 tokens in 3 usable documents"):
        GlobalBatchSampler(lengths, 100_000_000, max_seq_len=200)
    assert time.perf_counter() - t0 < 1.0


def test_output_prefix_naming_a_directory_is_refused(tmp_path, capsys):
    source = _jsonl(tmp_path / "a.jsonl", 3)
    for prefix in (f"{tmp_path}/", str(tmp_path)):  # would write hidden DIR/.bin, DIR/.idx
        with pytest.raises(SystemExit):
            _build_tool()(["--input", str(source), "--output-prefix", prefix])
        assert f"{prefix!r} names a directory" in capsys.readouterr().err
    assert not (tmp_path / ".bin").exists() and not (tmp_path / ".idx").exists()


def test_an_empty_dataset_is_named_when_it_opens(tmp_path):
    """Issue 48: an empty jsonl or indexed dataset fails naming the file (was a sampler's
    "no document has at least 2 tokens" on every rank, naming nothing)."""
    import importlib

    from megatron_dcp.data import ByteTokenizer, open_dataset

    prefix = str(tmp_path / "empty")
    with IndexedDatasetWriter(prefix):
        pass
    with pytest.raises(ValueError, match=f"{prefix}.bin/.idx holds no tokens"):
        open_dataset(prefix, 257)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        pretrain = importlib.import_module("pretrain")
    finally:
        sys.path.remove(str(ROOT / "examples"))
    with pytest.raises(ValueError, match="empty.jsonl: no document of at least 2 tokens"):
        pretrain._dataset(str(empty), ByteTokenizer())
