"""A small SFT data set for Megatron-LM's ``--sft`` (the launcher's tests): a JSONL of packed
conversations and a word-level Hugging Face tokenizer with the special tokens of Megatron-LM's
``nemotron-h-aligned`` prompt format (``--sft-tokenizer-prompt-format``, its default).

    python tests/megatron_lm_style/sft_data.py FOLDER

writes ``FOLDER/sft.jsonl`` and ``FOLDER/tokenizer/``; then ``--sft --data-path
FOLDER/sft.jsonl --tokenizer-type SFTTokenizer --tokenizer-model FOLDER/tokenizer``.

Each JSONL line is one sample: ``{"messages": [...]}``, conversations one after the other, each
starting with its ``system`` message (Megatron-LM's ``SFTDataset`` splits them there, packs
them into ``--seq-length`` tokens, truncates the last one that does not fit and pads the rest;
the system and user turns, the padding and the target across a conversation boundary are
masked). The lines mix short conversations, several turns, a conversation longer than a
sample (it fills its sample, truncated) and samples padded at their end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<unk>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_233>"]
"""``<SPECIAL_10>``/``<SPECIAL_11>``: the format's role markers; ``<SPECIAL_233>``: its pad."""


def write_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer (whitespace-split words of `WORDS`, the roles' names, `SPECIAL`)
    saved as Hugging Face's ``AutoTokenizer`` loads it; 48 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + ["System", "User", "Assistant"] + WORDS)}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL[2:]})
    fast.save_pretrained(str(folder))
    return folder


def _text(rng, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(low, high))))


def conversation(rng, turns: int, answer: tuple = (3, 40)) -> list[dict]:
    """A system message and ``turns`` user/assistant pairs of random words."""
    out = [{"role": "system", "content": _text(rng, 1, 6)}]
    for _ in range(turns):
        out += [{"role": "user", "content": _text(rng, 2, 30)},
                {"role": "assistant", "content": _text(rng, *answer)}]
    return out


def samples(seed: int = 0) -> list[list[dict]]:
    """The lines' messages: packed conversations of a few turns; one conversation longer than
    a 256-token sample; one short one (a sample mostly padding)."""
    rng = np.random.default_rng(seed)
    lines = [sum((conversation(rng, int(rng.integers(1, 4)))
                  for _ in range(int(rng.integers(1, 5)))), []) for _ in range(6)]
    lines.insert(2, conversation(rng, 8, answer=(30, 40)))  # truncated: fills its sample
    lines.append(conversation(rng, 1))
    return lines


def write_sft_data(folder: Path) -> tuple[Path, Path]:
    """``folder/sft.jsonl`` and ``folder/tokenizer``: (the JSONL, the tokenizer folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sft.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in samples()))
    return path, write_tokenizer(folder / "tokenizer")


if __name__ == "__main__":
    print(*write_sft_data(Path(sys.argv[1])))
