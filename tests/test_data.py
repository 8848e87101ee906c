"""Data: embedded corpus, byte tokenizer, indexed dataset round trip (and Megatron interop),
jsonl reading, the build tool, and the global-batch sampler's determinism and resume."""

import json
import subprocess
import sys

import numpy as np
import pytest

from megatron_dcp.data import (ByteTokenizer, GlobalBatchSampler, IndexedDataset,
                               IndexedDatasetWriter,
                               embedded_corpus_texts, embedded_dataset, open_dataset,
                               read_documents)


def test_embedded_corpus_is_long_tailed():
    texts = embedded_corpus_texts()
    lengths = np.array(sorted(len(t.encode()) for t in texts))
    assert len(lengths) > 5000
    median, p99, longest = np.median(lengths), np.percentile(lengths, 99), lengths[-1]
    assert median < 300 and p99 > 20 * median and longest > 300 * median


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld — ok"
    ids = tok.encode(text)
    assert ids[-1] == tok.eod and ids.max() < tok.vocab_size
    assert tok.decode(ids[:-1]) == text
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])


def test_indexed_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 257, size=n) for n in [1, 5, 0, 300, 17]]
    prefix = str(tmp_path / "sub" / "ds")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs)
    assert list(ds.lengths) == [len(d) for d in docs]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds.get(3, offset=10, length=5), docs[3][10:15])
    assert ds.dtype == np.uint16
    with pytest.raises(IndexError):
        ds[len(docs)]


def test_indexed_readable_by_megatron_core(tmp_path):
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    prefix = str(tmp_path / "ds")
    docs = [np.arange(n, dtype=np.int64) % 257 for n in (3, 9, 4)]
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    theirs = mcore.IndexedDataset(prefix, mmap=True)
    assert len(theirs) == 3
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)


def test_indexed_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        IndexedDataset(str(tmp_path / "missing"))
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" + b"\0" * 40)
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a Megatron MMIDIDX"):
        IndexedDataset(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="do not fit"):
        IndexedDatasetWriter(str(tmp_path / "x"), np.uint8).add_document([300])


def test_read_documents(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert list(read_documents(str(jl))) == ["one", "two"]
    txt = tmp_path / "a.txt"
    txt.write_text("para one\nline two\n\n\npara two\n")
    assert list(read_documents(str(txt))) == ["para one\nline two\n", "para two\n"]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": 1}\n')
    with pytest.raises(ValueError, match=r"b.jsonl:2: no 'text' field"):
        list(read_documents(str(bad)))


@pytest.mark.slow
def test_build_tool(tmp_path):
    jl = tmp_path / "in.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["alpha", "beta gamma"]))
    prefix = tmp_path / "out"
    subprocess.run([sys.executable, "tools/build_indexed_dataset.py", "--input", str(jl),
                    "--output-prefix", str(prefix)], check=True, capture_output=True)
    ds = open_dataset(str(prefix))
    tok = ByteTokenizer()
    assert [tok.decode(ds[i][:-1]) for i in range(len(ds))] == ["alpha", "beta gamma"]


def test_sampler_budget_and_determinism():
    lengths = embedded_dataset().lengths
    a = GlobalBatchSampler(lengths, 4096, seed=3, max_seq_len=1024)
    b = GlobalBatchSampler(lengths, 4096, seed=3, max_seq_len=1024)
    c = GlobalBatchSampler(lengths, 4096, seed=4, max_seq_len=1024)
    batches_a = [a.next_batch() for _ in range(20)]
    assert batches_a == [b.next_batch() for _ in range(20)]
    assert batches_a != [c.next_batch() for _ in range(20)]
    for batch in batches_a:
        assert sum(a.sequence_length(d) for d in batch) <= 4096
        assert all(lengths[d] >= 2 for d in batch)


def test_sampler_resume_and_epochs():
    lengths = np.array([5, 1, 7, 3, 9, 2, 4])
    full = GlobalBatchSampler(lengths, 10, seed=1)
    expected = [full.next_batch() for _ in range(12)]  # several epochs
    first = GlobalBatchSampler(lengths, 10, seed=1)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = GlobalBatchSampler(lengths, 10, seed=1)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(7)] == expected[5:]
    seen = [d for batch in expected for d in batch]
    assert 1 not in seen  # a 1-token document has no target
    with pytest.raises(ValueError, match="tokens_per_batch"):
        GlobalBatchSampler(lengths, 20, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="below max_seq_len"):
        GlobalBatchSampler(lengths, 10, max_seq_len=64)
