"""Megatron-LM's ``--sft`` through the launcher (issue 57, item 2), and documents that fill a
sample at the token budget's boundary (issue 60, item 2). megatron-core 0.19's SFT dataset
packs conversations into ``--seq-length`` tokens and masks their prompts, the target across a
conversation boundary and the padding: the launcher's documents carry Megatron-LM's labels and
loss mask, so ``--dcp`` trains plain Megatron-LM's per-token loss (sum of mask x cross-entropy
over the sum of the mask, over the global batch) whatever the plan."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training", reason="Megatron-LM's training package (megatron-core "
                    "0.19, Python 3.12: the .venv312 leg of make test)")
pytestmark = pytest.mark.slow  # every test here launches processes

from test_megatron_launcher import (COMMON, PLAIN, SEQ, _launch, _lm_losses,  # noqa: E402
                                    _rows_that_split, _same_losses)

sys.path.insert(0, str(Path(__file__).resolve().parent / "megatron_lm_style"))
from sft_data import write_sft_data  # noqa: E402


def _sft_common(folder: Path) -> tuple:
    """`COMMON` for ``--sft`` on `sft_data`'s JSONL and tokenizer (Megatron-LM's SFT dataset
    builds no attention mask: ``--no-create-attention-mask-in-dataloader``)."""
    data, tokenizer = write_sft_data(folder)
    common = [w for w in COMMON if w not in ("--mock-data", "--dataloader-inter-document-masking")]
    common[common.index("--tokenizer-type") + 1] = "SFTTokenizer"
    at = common.index("--vocab-size")
    del common[at:at + 2]
    return (*common, "--sft", "--data-path", str(data), "--tokenizer-model", str(tokenizer),
            "--split", "100,0,0", "--no-create-attention-mask-in-dataloader")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pp", [1, 2], ids=["dp2", "dp2xpp2"])
def test_sft_equals_plain_megatron_lm(tmp_path, pp):
    """``--sft`` at DP 2 and DP 2 x PP 2 with a budget in tokens only: the lm loss lines are
    plain Megatron-LM's (relative <= 1e-5) while the plans split documents; the rows count
    the tokens trained (the unmasked targets) apart from the tokens run (Megatron-LM's global
    batch x --seq-length). Before, DCP refused the masked prompts ("sample 0 has loss-masked
    tokens inside its document")."""
    common = _sft_common(tmp_path / "data")
    extra = ["--pipeline-model-parallel-size", str(pp)]
    log = tmp_path / "dcp.jsonl"
    dcp = _lm_losses(_launch(["--dcp", "--dcp-log-json", str(log), "--dcp-max-tokens-per-rank",
                              "200", *extra], ranks=2 * pp, common=common))
    plain = _lm_losses(_launch(PLAIN + extra, ranks=2 * pp, common=common))
    _same_losses(dcp, plain)
    rows = _rows_that_split(log)
    assert all(r["tokens_run"] == 4 * SEQ for r in rows), rows
    assert all(0 < r["tokens"] < 4 * SEQ for r in rows), rows  # prompts, padding masked


@pytest.mark.timeout(600)
def test_documents_that_fill_samples_train_at_ranks_x_tokens_per_rank(tmp_path):
    """Issue 60, item 2: ``--seq-length 1024 --dcp-max-tokens-per-rank 512`` on 2 ranks (the
    sequence length is ranks x tokens a rank, as with Megatron's
    ``--max-seqlen-per-dp-cp-rank``) trains 5 iterations on documents that fill their samples
    (Megatron's mock documents are up to 4,095 tokens long). Before, a document filling a
    sample carried its last target as a 1,025th token: "sequence 0 has 1025 tokens and fits no
    group"."""
    seq = "1024"
    common = list(COMMON)
    for flag in ("--seq-length", "--max-position-embeddings"):
        common[common.index(flag) + 1] = seq
    log = tmp_path / "dcp.jsonl"
    losses = _lm_losses(_launch(["--dcp", "--dcp-log-json", str(log),
                                 "--dcp-max-tokens-per-rank", "512"], common=tuple(common)))
    assert sorted(losses) == [1, 2, 3, 4, 5]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(r["tokens_run"] == 4 * 1024 for r in rows), rows
    # four samples of at most six documents: two samples at least are one document each,
    # of 1,024 tokens, at degree 2 (512 a rank)
    assert all(r["sequences"] <= 6 and r["plan"]["degrees"].get("2", 0) >= 2 for r in rows), rows
