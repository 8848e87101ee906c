"""Loss masks of an indexed dataset: a parallel mask dataset ``PREFIX_mask.bin/.idx``.

A token dataset ``PREFIX.bin/.idx`` (Megatron's MMIDIDX) carries no mask. Its loss mask is a
second indexed dataset beside it, ``PREFIX_mask.bin/.idx``, in the same format: dtype uint8,
one value per token, the same sequences (documents) with the same lengths in the same order.
``mask[i]`` of a document says whether token ``i`` is trained *as a target* (1) or not (0): the
loss of predicting token ``i`` from the tokens before it. So the weight of the next-token target
of position ``j`` (``labels[j] = tokens[j + 1]``) is ``mask[j + 1]`` (`target_weights`); the
first token of a document is no target, whatever its mask. An SFT document ``prompt +
response + EOD`` has mask 0 over the prompt and 1 over the response and its EOD (the model
learns to answer and to stop, never to write prompts).

`mask_prefix` names the mask of a token dataset, `open_masked` opens both (refusing a mask whose
documents do not line up with the tokens', naming both files), `MaskedDataset` serves a
document's tokens as ``ds[i]`` (what the sampler and examples read) and its mask as
``ds.mask(i)``; `encode_pair` is what ``dcp-build-dataset --prompt-key/--response-key``
writes for one JSONL line.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np

from megatron_dcp.data.indexed import IndexedDataset

MASK_SUFFIX = "_mask"
"""The mask dataset of ``PREFIX`` is ``PREFIX_mask.bin/.idx``."""


def mask_prefix(prefix: str) -> str:
    """The prefix of ``prefix``'s mask dataset."""
    return prefix + MASK_SUFFIX


def mask_files(prefix: str) -> list[str]:
    """The files of ``prefix``'s mask dataset that exist (none, one of two, or both)."""
    return [p for p in (mask_prefix(prefix) + s for s in (".bin", ".idx")) if os.path.exists(p)]


def target_weights(mask: np.ndarray) -> np.ndarray:
    """The loss weight of each next-token target of a document with this ``mask``: position
    ``j``'s target is token ``j + 1``, trained where ``mask[j + 1]`` is 1; the last position
    has no target (float64, ``len(mask)`` values)."""
    weights = np.zeros(len(mask), dtype=np.float64)
    weights[:-1] = mask[1:]
    return weights


def encode_pair(tokenizer, prompt: str, response: str, append_eod: bool = True
                ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of one prompt/response document: ``prompt + response (+ EOD)``, the
    prompt's tokens masked (0), the response's and its EOD trained (1)."""
    head = tokenizer.encode(prompt, append_eod=False)
    tail = tokenizer.encode(response, append_eod=append_eod)
    mask = np.concatenate([np.zeros(len(head), np.uint8), np.ones(len(tail), np.uint8)])
    return np.concatenate([head, tail]), mask


class MaskedDataset:
    """A token dataset and its mask dataset: ``ds[i]`` the tokens of document ``i``,
    ``ds.mask(i)`` its mask (uint8, as many values), ``lengths`` the tokens'."""

    def __init__(self, tokens: IndexedDataset, mask: IndexedDataset) -> None:
        self.tokens, self.masks = tokens, mask
        self.prefix = tokens.prefix
        self.mask_prefix = mask.prefix

    @property
    def lengths(self) -> np.ndarray:
        """Token count of every document."""
        return self.tokens.lengths

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[i]

    def mask(self, i: int) -> np.ndarray:
        """The mask of document ``i`` (1: the token is trained as a target)."""
        return self.masks[i]

    def check_vocabulary(self, vocab_size: int) -> None:
        """The tokens' ids against ``vocab_size`` (`IndexedDataset.check_vocabulary`)."""
        self.tokens.check_vocabulary(vocab_size)


def open_masked(prefix: str, tokens: Optional[IndexedDataset] = None) -> MaskedDataset:
    """``prefix``'s tokens (``tokens`` when already open) with its mask ``prefix_mask``: the
    mask's dtype must be uint8 and its documents those of the tokens (count and every length),
    its values 0 or 1; a ValueError names both files and the first document that differs."""
    tokens = tokens if tokens is not None else IndexedDataset(prefix)
    where = mask_prefix(prefix)
    mask = IndexedDataset(where)
    pair = (f"the loss mask {where}.bin/.idx does not line up with the tokens "
            f"{prefix}.bin/.idx")
    fix = "rebuild both with dcp-build-dataset --prompt-key/--response-key, or remove the mask"
    if mask.dtype != np.uint8:
        raise ValueError(f"{where}.idx: dtype {mask.dtype}, a loss mask is uint8 (one 0/1 "
                         f"value a token); {fix}")
    if len(mask) != len(tokens):
        raise ValueError(f"{pair}: {len(mask)} documents, the tokens {len(tokens)}; {fix}")
    differ = np.flatnonzero(mask.lengths != tokens.lengths)
    if differ.size:
        i = int(differ[0])
        raise ValueError(f"{pair}: document {i} has {int(mask.lengths[i])} mask values and "
                         f"{int(tokens.lengths[i])} tokens; {fix}")
    low, high = mask.token_range()
    if low is not None and (low < 0 or high > 1):
        raise ValueError(f"{where}.bin holds the value {high if high > 1 else low}: a loss mask "
                         f"holds 0 (not trained) or 1 (trained); {fix}")
    return MaskedDataset(tokens, mask)


def dataset_batch(dataset: Any, docs: Sequence[int], seq_length: int) -> list:
    """The token tensors of documents ``docs`` of an indexed dataset, cut at ``seq_length``;
    of a `MaskedDataset` a `megatron_dcp.runtime.targets.WeightedBatch` whose targets weigh by
    its mask (`target_weights`: the target of position j, token j + 1, is trained where the
    mask of j + 1 is 1). The examples' global batch."""
    import torch

    from megatron_dcp.runtime.targets import WeightedBatch

    sequences = [torch.from_numpy(dataset[d][:seq_length].astype("int64")) for d in docs]
    if not isinstance(dataset, MaskedDataset):
        return sequences
    return WeightedBatch(sequences, weights=[
        torch.from_numpy(target_weights(dataset.mask(d)[:seq_length])) for d in docs])
