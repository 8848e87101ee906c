"""Issue 57 item 2: both examples train on a dataset's loss mask (``PREFIX_mask``, built by
``dcp-build-dataset --prompt-key/--response-key``) exactly.

- examples/pretrain.py (DeepSpeed, 2 ranks, ZeRO 1): ``--dcp`` under a memory budget that splits
  the long documents equals plain data parallel at every iteration (relative 1e-5), and the first
  iteration's loss is the one-process reference computed from the mask (sum of the trained
  targets' cross-entropy over their count); the rows' ``tokens`` are the mask's trained targets.
- examples/pretrain_megatron.py (torchrun, 2 ranks): ``--dcp`` equals Megatron's plain data
  parallel, whose ``loss_mask`` is the mask, and both count the mask's trained targets.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parents[1]
SEED = 7
COMMON = ["--train-iters", "3", "--global-batch-tokens", "2048", "--seq-length", "512",
          "--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seed", str(SEED),
          "--quiet"]


def masked_dataset(folder: Path) -> str:
    """An SFT dataset of 40 documents of the embedded corpus (60 to 1,500 characters: some cut
    at 512 tokens), each its first third as the prompt and the rest as the response."""
    from megatron_dcp.data import embedded_corpus_texts

    texts = [t for t in embedded_corpus_texts() if 60 < len(t.encode()) < 1500][:40]
    source = folder / "sft.jsonl"
    source.write_text("".join(json.dumps({"prompt": t[:len(t) // 3], "response": t[len(t) // 3:]})
                              + "\n" for t in texts))
    prefix = str(folder / "sft")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_indexed_dataset
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert build_indexed_dataset.main(["--input", str(source), "--output-prefix", prefix,
                                       "--prompt-key", "prompt", "--response-key",
                                       "response"]) == 0
    return prefix


def first_batch(prefix: str, budget: int, seq_length: int, seed: int):
    """The documents of the examples' first global batch, cut at ``seq_length``, with their
    masks: the sampler the examples build."""
    from megatron_dcp.data import GlobalBatchSampler, open_dataset

    data = open_dataset(prefix, 257, loss_mask=True)
    docs = GlobalBatchSampler(data.lengths, budget, seed=seed, max_seq_len=seq_length).next_batch()
    return [(data[d][:seq_length].astype("int64"), data.mask(d)[:seq_length]) for d in docs]


def trained_targets(batch) -> int:
    """Targets the mask trains (a document's first token is no target)."""
    return sum(int(mask[1:].sum()) for _, mask in batch)


def reference_loss(batch) -> float:
    """One process, the reference decoder as examples/pretrain.py builds it: the sum over the
    trained targets of their cross-entropy, over their count."""
    import torch

    from megatron_dcp.data import target_weights
    from megatron_dcp.models.decoder import Decoder, DecoderConfig

    torch.manual_seed(SEED)
    model = Decoder(DecoderConfig(vocab_size=257, hidden_size=32, num_layers=2, num_heads=4,
                                  max_position=512), seed=SEED)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for tokens, mask in batch:
            ids = torch.from_numpy(tokens)
            weights = torch.from_numpy(target_weights(mask))
            labels = torch.cat([ids[1:], ids.new_full((1,), -100)])
            losses = model(ids, labels=labels).double()
            total += float((losses * weights).sum())
            count += float(weights.sum())
    return total / count


# ---------------------------------------------------------------------- DeepSpeed (in the job)
def _driver(prefix: str, out: str) -> None:
    """``--dcp`` (a budget that splits the long documents) and plain data parallel on the
    masked dataset, in one job; rank 0 writes both logs' rows to ``out``."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain
    from test_deepspeed_parity import H200, _tight_budget

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    logs = {m: out + f".{m}.jsonl" for m in ("dcp", "dp")}
    budget = ["--dcp_memory_budget_gb", _tight_budget(world, 1), *H200]
    for mode, log in logs.items():
        flags = ["--dcp", *budget] if mode == "dcp" else []
        pretrain.main(COMMON + ["--zero-stage", "1", "--data-path", prefix, "--log-json", log,
                                *flags])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({m: [json.loads(line) for line in open(p)] for m, p in logs.items()}, f)
    dist.barrier()


@pytest.mark.timeout(400)
def test_deepspeed_example_trains_the_mask_exactly(tmp_path):
    from distributed import launch_deepspeed

    prefix = masked_dataset(tmp_path)
    out = tempfile.mktemp(suffix=".json", dir=tmp_path)
    proc = launch_deepspeed(2, [__file__, "--data", prefix, "--out", out], 380)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(Path(out).read_text())
    dcp, dp = rows["dcp"], rows["dp"]
    assert len(dcp) == len(dp) == 3
    for a, b in zip(dcp, dp):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])
        assert a["tokens"] == b["tokens"] and a["tokens_run"] == b["tokens_run"]
    assert any(int(d) > 1 for r in dcp for d in r["plan"]["degrees"]), [r["plan"] for r in dcp]
    batch = first_batch(prefix, 2048, 512, SEED)
    trained = trained_targets(batch)
    assert dcp[0]["tokens"] == trained < dcp[0]["tokens_run"] == sum(len(t) for t, _ in batch)
    expected = reference_loss(batch)
    assert abs(dcp[0]["loss"] - expected) <= 1e-5 * expected, (dcp[0]["loss"], expected)


# ---------------------------------------------------------------------- Megatron (torchrun)
@pytest.mark.timeout(400)
def test_megatron_example_trains_the_mask_as_megatron_does(tmp_path):
    from test_megatron_example import COMMON as MEGATRON, _budget_gb, _train

    prefix = masked_dataset(tmp_path)
    data = ["--data-path", prefix]
    dcp = _train(tmp_path, "dcp", ["--dcp", "--dcp-pack-tokens", "256", "--dcp-hardware",
                                   "h200", "--dcp-memory-budget-gb", f"{_budget_gb(200):.6f}",
                                   *data])
    plain = _train(tmp_path, "plain", data)
    assert len(dcp) == len(plain) == 2
    for a, b in zip(dcp, plain):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])
        assert a["tokens_run"] == b["tokens_run"]
    assert "2" in dcp[0]["plan"]["degrees"], dcp[0]["plan"]
    budget = int(MEGATRON[MEGATRON.index("--global-batch-tokens") + 1])
    seq = int(MEGATRON[MEGATRON.index("--seq-length") + 1])
    batch = first_batch(prefix, budget, seq, 1234)  # the example's default seed
    # Megatron's plain loss_mask and DCP's weights: the mask's trained targets, both
    assert dcp[0]["tokens"] == plain[0]["tokens"] == trained_targets(batch)
    assert dcp[0]["tokens"] < dcp[0]["tokens_run"] == sum(len(t) for t, _ in batch)


@pytest.mark.timeout(300)
def test_a_mask_that_does_not_line_up_is_refused_at_start(tmp_path):
    """The Megatron example (torchrun, 1 rank) refuses a mask of another dataset: the message
    naming both files, status 1, no traceback (the DeepSpeed example's same refusal:
    tests/test_loss_mask_data.py)."""
    import subprocess

    from distributed import JOB_ENV

    from megatron_dcp.data import IndexedDataset, IndexedDatasetWriter

    prefix = masked_dataset(tmp_path)
    old = IndexedDataset(prefix)
    with IndexedDatasetWriter(prefix + "_mask", np.uint8) as writer:  # one document short
        for i in range(len(old) - 1):
            writer.add_document(np.ones(int(old.lengths[i]), np.uint8))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "1", "examples/pretrain_megatron.py", "--data-path", prefix]
    done = subprocess.run(cmd, cwd=ROOT, env=JOB_ENV, capture_output=True, text=True,
                          timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert (f"error: the loss mask {prefix}_mask.bin/.idx does not line up with the tokens "
            f"{prefix}.bin/.idx: {len(old) - 1} documents, the tokens {len(old)}") in out, \
        out[-3000:]
    assert not [line for line in out.splitlines()
                if line.strip().startswith("File ") and "examples/" in line], out[-3000:]


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    try:
        _driver(a.data, a.out)
    finally:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()
