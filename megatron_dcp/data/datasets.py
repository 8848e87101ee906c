"""Token datasets: the embedded corpus, Megatron indexed datasets, and one opener for both."""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path
from typing import Optional, Protocol, Sequence

import numpy as np

from megatron_dcp.data.indexed import IndexedDataset
from megatron_dcp.data.loss_mask import mask_files, open_masked
from megatron_dcp.data.tokenizer import ByteTokenizer

EMBEDDED_CORPUS = Path(__file__).parent / "corpus" / "pystdlib.jsonl.gz"


class TokenDataset(Protocol):
    """What the sampler and training scripts need: ``len``, ``ds[i]`` (token ids), ``lengths``."""

    lengths: np.ndarray

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


class InMemoryTokenDataset:
    """Documents already tokenized, held in memory (the embedded corpus, tests)."""

    def __init__(self, documents: Sequence[np.ndarray], name: str = "in-memory") -> None:
        self.documents = [np.asarray(d) for d in documents]
        self.lengths = np.array([len(d) for d in self.documents], dtype=np.int64)
        self.name = name

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.documents[i]


@lru_cache(maxsize=1)
def embedded_corpus_texts() -> tuple[str, ...]:
    """The texts of the embedded corpus (see corpus/README.md), in file order."""
    with gzip.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line)["text"] for line in f if line.strip())


def embedded_dataset(tokenizer: Optional[ByteTokenizer] = None) -> InMemoryTokenDataset:
    """The embedded corpus tokenized (byte-level, EOD appended): ~5.8k documents, long-tailed."""
    tokenizer = tokenizer or ByteTokenizer()
    docs = [tokenizer.encode(t) for t in embedded_corpus_texts()]
    return InMemoryTokenDataset(docs, name="embedded:pystdlib")


def open_dataset(data_path: Optional[str] = None, vocab_size: Optional[int] = None,
                 loss_mask: bool = False) -> TokenDataset:
    """``--data-path PREFIX`` (a Megatron ``.bin/.idx`` pair) or, when None, the embedded corpus.
    ``vocab_size``: check every token id of an indexed dataset against it now
    (`IndexedDataset.check_vocabulary`). ``loss_mask``: where ``PREFIX_mask.bin/.idx`` lie
    beside it, a `MaskedDataset` with that loss mask (`megatron_dcp.data.loss_mask`; half a
    mask, or one whose documents are not the tokens', is refused naming the files)."""
    if data_path is None:
        return embedded_dataset()
    if data_path.endswith((".bin", ".idx")):
        data_path = data_path[:-4]
    dataset = IndexedDataset(data_path)
    if len(dataset) == 0 or not any(dataset.lengths):  # a sampler would find nothing to batch
        raise ValueError(f"indexed dataset {data_path}.bin/.idx holds no tokens "
                         f"({len(dataset)} documents): rebuild it from non-empty input "
                         f"(--data-path {data_path})")
    if vocab_size is not None:
        dataset.check_vocabulary(vocab_size)
    found = mask_files(data_path) if loss_mask else []
    if len(found) == 1:  # a mask that lost a file: training without it would be silent
        other = found[0][:-4] + (".idx" if found[0].endswith(".bin") else ".bin")
        raise ValueError(f"the loss mask {found[0]} lies beside {data_path}.bin/.idx without "
                         f"its {other}: rebuild the dataset (dcp-build-dataset), or remove "
                         f"{found[0]} to train every token")
    return open_masked(data_path, dataset) if found else dataset
