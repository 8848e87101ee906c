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


# ------------------------------------------------- issue 59, item 5: readers as strict as any
def _examples():
    """The two examples' dataset openers (DeepSpeed's ``_dataset``, Megatron's
    ``open_training_data``), each as ``open(prefix)``."""
    import importlib

    from megatron_dcp.data import ByteTokenizer

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        pretrain = importlib.import_module("pretrain")
        pretrain_megatron = importlib.import_module("pretrain_megatron")
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return {"deepspeed": lambda p: pretrain._dataset(p, ByteTokenizer(), 257),
            "megatron": lambda p: pretrain_megatron.open_training_data(
                pretrain_megatron.parse_args(["--data-path", p]))}


def _float_dataset(prefix: str) -> None:
    """A float32 ``.bin/.idx`` as an older writer (or another tool) made it: ids 1.7, 2.2, ..."""
    with IndexedDatasetWriter(prefix, np.int32) as w:  # 4 bytes a token, as float32
        w.add_document([0, 0, 0])
        w.add_document([0, 0])
    np.array([1.7, 2.2, 200.9, 4.0, 5.5], np.float32).tofile(prefix + ".bin")
    with open(prefix + ".idx", "r+b") as f:
        f.seek(HEADER_BYTES - 17)  # the dtype code: after the magic and the version
        f.write(bytes([7]))


def test_a_float_dataset_is_refused_by_the_writer_and_every_reader(tmp_path):
    """Issue 59: a float32 dataset trained with its ids truncated (1.7 as 1) in both examples;
    the project's own writer wrote it."""
    for dtype in (np.float32, np.float64):
        with pytest.raises(ValueError, match=f"dtype {np.dtype(dtype)} is not an integer type"):
            IndexedDatasetWriter(str(tmp_path / "w"), dtype)
    with IndexedDatasetWriter(str(tmp_path / "w"), np.uint16) as w:
        with pytest.raises(ValueError, match="token ids must be integers, got float64"):
            w.add_document([1.5, 2.0])
        with pytest.raises(ValueError, match="do not fit dtype uint16 .ids run from 0"):
            w.add_document([3, -1])
        w.add_document([1, 2])
    prefix = str(tmp_path / "f32")
    _float_dataset(prefix)
    message = (r"f32.idx: dtype code 7 \(float32\) is not an integer type; a token dataset holds "
               r"integer ids")
    with pytest.raises(ValueError, match=message):
        IndexedDataset(prefix)
    for name, open_ in _examples().items():
        with pytest.raises(ValueError, match=message):
            open_(prefix)


def _negative_dataset(prefix: str) -> None:
    """int16 ids with a -3 at document 1, position 2 (the writer refuses it: bytes patched)."""
    with IndexedDatasetWriter(prefix, np.int16) as w:
        w.add_document([1, 3, 4])
        w.add_document([4, 5, 6, 7])
    tokens = np.memmap(prefix + ".bin", dtype=np.int16, mode="r+")
    tokens[5] = -3
    tokens.flush()
    del tokens


def test_a_negative_token_id_is_refused_when_the_dataset_opens(tmp_path):
    """Issue 59: a negative id passed the open (ids were checked against the vocabulary's top
    only) and failed inside the step."""
    prefix = str(tmp_path / "neg")
    _negative_dataset(prefix)
    message = (r"neg.bin: document 1 has token id -3 at position 2, outside the model's "
               r"vocabulary of 257 \(ids 0..256; no tokenizer makes a negative id")
    for name, open_ in _examples().items():
        with pytest.raises(ValueError, match=message):
            open_(prefix)


def test_the_token_id_scan_is_cached_by_the_index_checksum(tmp_path, monkeypatch, capsys):
    """The scan's id range is kept in a small JSON file under DCP_CACHE_DIR, keyed by the .idx's
    checksum and the .bin's size and mtime: a second open reads no token, a changed .bin is
    scanned again, an unwritable cache folder costs a scan, never a failure."""
    from megatron_dcp.data import indexed, open_dataset

    cache = tmp_path / "cache"
    monkeypatch.setenv("DCP_CACHE_DIR", str(cache))
    prefix = str(tmp_path / "ids")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in ([1, 2, 3], [4, 5], [6, 250, 7, 8]):
            w.add_document(doc)
    scans = []
    real_tokens = IndexedDataset._tokens
    monkeypatch.setattr(IndexedDataset, "_tokens",
                        lambda self: scans.append(self.prefix) or real_tokens(self))
    open_dataset(prefix, 257)
    entries = list(cache.glob("*.json"))
    assert len(scans) == 1 and len(entries) == 1
    assert json.loads(entries[0].read_text())["min"] == 1
    assert json.loads(entries[0].read_text())["max"] == 250
    open_dataset(prefix, 257)
    open_dataset(prefix, 300)  # another vocabulary: the same range answers
    assert len(scans) == 1
    # a narrower vocabulary is refused from the cached range, naming the document (a scan)
    with pytest.raises(ValueError, match="document 2 has token id 250 at position 1"):
        open_dataset(prefix, 200)
    # the .bin rewritten in place (same size, later mtime) with an id past the vocabulary
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
    tokens[0] = 280
    tokens.flush()
    del tokens
    os.utime(prefix + ".bin", ns=(1, os.stat(prefix + ".idx").st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match="document 0 has token id 280 at position 0"):
        open_dataset(prefix, 257)
    # a cache entry that is not one (truncated, wrong types) is ignored, then rewritten
    scans.clear()
    for entry in cache.glob("*.json"):
        entry.write_text('{"min": "x"')
    open_dataset(prefix, 300)
    assert len(scans) == 1
    # an unwritable cache folder (a file in its place): a scan each time, no failure
    monkeypatch.setenv("DCP_CACHE_DIR", str(tmp_path / "ids.bin" / "cache"))
    open_dataset(prefix, 300)
    open_dataset(prefix, 300)
    assert len(scans) == 3
    # a slow scan says how far it is (here: every chunk, of 2 tokens)
    monkeypatch.setenv("DCP_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(indexed, "_PROGRESS_S", 0.0)
    monkeypatch.setattr(indexed, "_CHECK_CHUNK", 2)
    capsys.readouterr()
    open_dataset(prefix, 300)
    err = capsys.readouterr().err
    assert f"checking the token ids of {prefix}.bin: 22% (0.0 of 0.0 GB" in err
    assert "100%" in err


def _launcher_args(**flags):
    """The data flags of Megatron-LM's parsed arguments, as `check_data_args` reads them."""
    import argparse

    names = ("data_path", "data_args_path", "train_data_path", "valid_data_path",
             "test_data_path", "per_split_data_args_path")
    return argparse.Namespace(mock_data=False, sft=False, **{n: flags.get(n) for n in names})


def test_the_launcher_checks_every_data_flag_as_the_examples_do(tmp_path):
    """Issue 59: the launcher handed its prefixes to Megatron-LM's IndexedDataset, which trusts
    them: a wrong dtype code trained on misread bytes, a truncated .bin failed without the file's
    name, ids outside the vocabulary showed only when their batch came. Every prefix of every
    data flag (blends: weights interleaved) now goes through the examples' opener."""
    pytest.importorskip("megatron.training", reason="Megatron-LM's training package (.venv312)")
    from megatron_dcp.megatron.lm_datasets import check_data_args

    good = str(tmp_path / "good")
    with IndexedDatasetWriter(good, np.uint16) as w:
        for doc in ([1, 2, 3], [4, 5, 6, 7]):
            w.add_document(doc)
    # a wrong dtype code: uint16 data announced as int32
    wrong = str(tmp_path / "wrong")
    for suffix in (".bin", ".idx"):
        (tmp_path / ("wrong" + suffix)).write_bytes((tmp_path / ("good" + suffix)).read_bytes())
    with open(wrong + ".idx", "r+b") as f:
        f.seek(HEADER_BYTES - 17)
        f.write(bytes([4]))
    # a truncated .bin
    cut = str(tmp_path / "cut")
    (tmp_path / "cut.idx").write_bytes((tmp_path / "good.idx").read_bytes())
    (tmp_path / "cut.bin").write_bytes((tmp_path / "good.bin").read_bytes()[:8])
    f32, neg = str(tmp_path / "f32"), str(tmp_path / "neg")
    _float_dataset(f32)
    _negative_dataset(neg)
    big = str(tmp_path / "big")
    with IndexedDatasetWriter(big, np.uint16) as w:
        w.add_document([1, 2, 300])
    faults = {wrong: r"wrong.idx: sequence 1 starts at byte 6, expected 12 .* or its dtype code "
                     r"\(4 bytes a token\) is not the .bin's",
              cut: r"cut.bin has 8 bytes, its index .*cut.idx describes 14",
              f32: r"f32.idx: dtype code 7 \(float32\) is not an integer type",
              neg: r"neg.bin: document 1 has token id -3 at position 2",
              big: r"big.bin: document 0 has token id 300 at position 2, outside the model's "
                   r"vocabulary of 257"}
    assert check_data_args(_launcher_args(data_path=[good]), 257) == [good]
    assert check_data_args(_launcher_args(data_path=["0.3", good]), 257) == [good]
    data_args = tmp_path / "blend.txt"
    per_split = tmp_path / "splits.json"
    for bad, message in faults.items():
        data_args.write_text(f"0.5 {good}\n0.5 {bad}\n")
        per_split.write_text(json.dumps({"train": [good], "valid": f"1 {bad}", "test": None}))
        for flags in ({"data_path": [bad]}, {"data_path": ["0.3", good, "0.7", bad]},
                      {"data_args_path": str(data_args)},
                      {"train_data_path": [good], "valid_data_path": [bad]},
                      {"test_data_path": [bad]}, {"per_split_data_args_path": str(per_split)}):
            with pytest.raises(ValueError, match=message):
                check_data_args(_launcher_args(**flags), 257)
    # the hook: Megatron-LM's set_global_variables, then one line and status 1 (no traceback)
    import argparse

    from megatron_dcp.megatron.lm_datasets import _checked

    args = _launcher_args(data_path=["1", neg])
    args.padded_vocab_size = 384  # no tokenizer built here: the padded vocabulary bounds the ids
    with pytest.raises(SystemExit) as stop:
        _checked(lambda a: None)(args)
    assert str(stop.value.code).startswith(f"megatron_dcp.megatron.run: {neg}.bin: document 1 "
                                           "has token id -3 at position 2")
    assert check_data_args(argparse.Namespace(mock_data=True), 257) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_launcher_refuses_a_bad_dataset_before_training(tmp_path):
    """One real launcher run (plain Megatron-LM, 1 rank): a wrong dtype code in the .idx
    (formerly: training on misread bytes) stops before any dataset is built, naming the file."""
    pytest.importorskip("megatron.training", reason="Megatron-LM's training package (.venv312)")
    import subprocess

    from test_megatron_launcher import COMMON, SCRIPT

    prefix = str(tmp_path / "wrong")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(40):
            w.add_document(np.arange(300) % 250)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(HEADER_BYTES - 17)
        f.write(bytes([4]))  # int32: every pointer but the first lands elsewhere
    common = [w for w in COMMON if w != "--mock-data"]
    common[common.index("--vocab-size") + 1] = "257"
    cmd = [sys.executable, "-m", "megatron_dcp.megatron.run",
           str(ROOT / "tests" / "megatron_lm_style" / "pretrain_gpt_style.py"), *common,
           "--data-path", prefix, "--split", "100,0,0", "--train-iters", "2",
           "--spec", "megatron_dcp.megatron.lm_spec", "layer_spec"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29547"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert f"megatron_dcp.megatron.run: {prefix}.idx: sequence 1 starts at byte 600, expected " \
           "1200" in out, out[-3000:]
    assert "Traceback" not in out and "iteration        1/" not in out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", ["pretrain.py", "pretrain_megatron.py"])
def test_a_refused_dataset_is_its_message_not_a_traceback(tmp_path, example):
    """Issue 59 item 7: the examples refused a bad dataset at open, naming the file, but
    below a traceback from every rank; now the message alone, status 1."""
    import subprocess

    from distributed import JOB_ENV, deepspeed_command

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    prefix = tmp_path / "f32"
    _float_dataset(str(prefix))
    data, message = ((str(empty), "empty.jsonl: no document of at least 2 tokens")
                     if example == "pretrain.py" else
                     (str(prefix), "f32.idx: dtype code 7 (float32) is not an integer type"))
    if example == "pretrain.py":
        cmd = deepspeed_command(1, "examples/pretrain.py", "--data-path", data)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "1", "examples/pretrain_megatron.py", "--data-path", data]
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=JOB_ENV,
                          capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "error: " in out and message in out, out[-3000:]
    assert not [line for line in out.splitlines()
                if line.strip().startswith("File ") and "examples/" in line], out[-3000:]
