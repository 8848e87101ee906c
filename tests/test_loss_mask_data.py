"""Issue 57 item 2 (data): a loss mask beside an indexed dataset (``PREFIX_mask.bin/.idx``),
built by ``dcp-build-dataset --prompt-key/--response-key`` from a JSONL, opened with the tokens
(`open_dataset(loss_mask=True)`), refused where it does not line up with them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_dcp.config import IGNORE_INDEX
from megatron_dcp.data import (ByteTokenizer, IndexedDataset, IndexedDatasetWriter, MaskedDataset,
                               mask_prefix, open_dataset, target_weights)
from megatron_dcp.runtime.targets import WeightedBatch

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [("Q: 2+2?", " 4"), ("Say hi", " hi there"), ("x", "yz")]


def _build_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_indexed_dataset",
                                                  ROOT / "tools" / "build_indexed_dataset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _sft(path: Path, pairs=PAIRS, key: str = "response") -> Path:
    path.write_text("".join(json.dumps({"prompt": p, key: r}) + "\n" for p, r in pairs))
    return path


def _masked(tmp_path: Path, name: str = "sft") -> str:
    prefix = str(tmp_path / name)
    assert _build_tool()(["--input", str(_sft(tmp_path / f"{name}.jsonl")), "--output-prefix",
                          prefix, "--prompt-key", "prompt", "--response-key", "response"]) == 0
    return prefix


def test_build_writes_tokens_and_a_mask_of_the_response(tmp_path, capsys):
    prefix = _masked(tmp_path)
    assert "loss mask" in capsys.readouterr().out
    data = open_dataset(prefix, 257, loss_mask=True)
    assert isinstance(data, MaskedDataset) and len(data) == len(PAIRS)
    tok = ByteTokenizer()
    for i, (prompt, response) in enumerate(PAIRS):
        expected = np.concatenate([tok.encode(prompt, append_eod=False), tok.encode(response)])
        assert data[i].tolist() == expected.tolist()
        mask = [0] * len(prompt.encode()) + [1] * (len(response.encode()) + 1)  # and the EOD
        assert data.mask(i).tolist() == mask
    # without loss_mask (the Megatron-LM launcher's check) the tokens alone
    assert isinstance(open_dataset(prefix, 257), IndexedDataset)


def test_mask_shifted_to_targets():
    """mask[i] = 1: token i is trained as a target, the loss of predicting it from tokens < i;
    the target of position j is token j + 1, so its weight is mask[j + 1]."""
    tokens = torch.tensor([10, 11, 12, 13, 14])
    mask = np.array([0, 0, 1, 1, 0], dtype=np.uint8)  # prompt 10 11, response 12 13, then 14
    weights = target_weights(mask)
    assert weights.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    batch = WeightedBatch([tokens], weights=[torch.from_numpy(weights)])
    # trained: 11 -> 12 and 12 -> 13; 10 -> 11 (prompt), 13 -> 14 (masked) and the last: none
    assert batch.labels[0].tolist() == [IGNORE_INDEX, 12, 13, IGNORE_INDEX, IGNORE_INDEX]
    assert batch.sums == [(2.0, 2)]


def _write(prefix: str, documents, dtype=np.uint8) -> None:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(np.asarray(doc))


@pytest.mark.parametrize("documents, dtype, message", [
    ([[0] * 10, [1] * 16], np.uint8, "2 documents, the tokens 3"),
    ([[0] * 10, [1] * 15, [1] * 4], np.uint8, "document 1 has 15 mask values and 16 tokens"),
    ([[0] * 10, [1] * 16, [2] * 4], np.uint8, "holds the value 2"),
    ([[0] * 10, [1] * 16, [1] * 4], np.uint16, "dtype uint16, a loss mask is uint8"),
], ids=["count", "length", "value", "dtype"])
def test_a_mask_that_does_not_line_up_is_refused_naming_both(tmp_path, documents, dtype,
                                                            message):
    prefix = _masked(tmp_path)
    _write(mask_prefix(prefix), documents, dtype)
    with pytest.raises(ValueError) as err:
        open_dataset(prefix, 257, loss_mask=True)
    assert message in str(err.value)
    assert f"{prefix}_mask" in str(err.value)
    if message.startswith(("2 documents", "document 1")):
        assert f"{prefix}.bin/.idx" in str(err.value)


def test_half_a_mask_is_refused(tmp_path):
    prefix = _masked(tmp_path)
    os.remove(mask_prefix(prefix) + ".idx")
    with pytest.raises(ValueError, match=f"{prefix}_mask.bin lies beside .* without its "
                       f"{prefix}_mask.idx"):
        open_dataset(prefix, 257, loss_mask=True)


def test_the_examples_refuse_a_misaligned_mask_with_its_message(tmp_path):
    from conftest import load_example

    prefix = _masked(tmp_path)
    _write(mask_prefix(prefix), [[0] * 10])
    pretrain = load_example("pretrain.py")
    with pytest.raises(ValueError, match="does not line up"):
        pretrain._dataset(prefix, ByteTokenizer(), 257)


@pytest.mark.parametrize("flags, message", [
    (["--prompt-key", "prompt"], "argument --prompt-key: needs --response-key"),
    (["--response-key", "response"], "argument --response-key: needs --prompt-key"),
    (["--prompt-key", "p", "--response-key", "r", "--json-key", "text"],
     "argument --json-key: not with --prompt-key"),
    (["--prompt-key", "p", "--response-key", "r", "--txt"], "is not jsonl"),
    (["--prompt-key", "p", "--response-key", "r", "--embedded"], "the embedded corpus has no"),
])
def test_build_flag_refusals(tmp_path, capsys, flags, message):
    build = _build_tool()
    text = tmp_path / "notes.txt"
    text.write_text("a paragraph\n")
    source = ["--input", str(_sft(tmp_path / "a.jsonl"))]
    if "--txt" in flags:
        flags, source = [f for f in flags if f != "--txt"], ["--input", str(text)]
    if "--embedded" in flags:
        source = []
    with pytest.raises(SystemExit) as exit_info:
        build([*source, "--output-prefix", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))


def test_failed_masked_build_keeps_the_dataset_and_its_mask(tmp_path, capsys):
    prefix = _masked(tmp_path)
    files = [prefix + s for s in (".bin", ".idx", "_mask.bin", "_mask.idx")]
    before = {f: Path(f).read_bytes() for f in files}
    bad = _sft(tmp_path / "bad.jsonl", key="answer")  # no "response" field
    assert _build_tool()(["--input", str(bad), "--output-prefix", prefix, "--prompt-key",
                          "prompt", "--response-key", "response", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:1: no 'response' field" in err and f"{prefix}_mask.bin/.idx" in err
    assert {f: Path(f).read_bytes() for f in files} == before
    assert sorted(os.listdir(tmp_path)) == sorted(["bad.jsonl", "sft.jsonl"] +
                                                  [os.path.basename(f) for f in files])


def test_a_mask_blocks_the_prefix_and_an_unmasked_rebuild_removes_it(tmp_path, capsys):
    prefix = _masked(tmp_path)
    for suffix in (".bin", ".idx"):
        os.remove(prefix + suffix)  # only the mask is left: still refused without --overwrite
    build = _build_tool()
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "hello world"}) + "\n")
    with pytest.raises(SystemExit):
        build(["--input", str(plain), "--output-prefix", prefix])
    assert f"{prefix}_mask.bin and {prefix}_mask.idx already exist" in capsys.readouterr().err
    assert build(["--input", str(plain), "--output-prefix", prefix, "--overwrite"]) == 0
    assert f"removed {prefix}_mask.bin" in capsys.readouterr().out
    assert not os.path.exists(prefix + "_mask.bin") and not os.path.exists(prefix + "_mask.idx")
    assert isinstance(open_dataset(prefix, 257, loss_mask=True), IndexedDataset)
