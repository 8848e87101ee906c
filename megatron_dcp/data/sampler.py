"""`GlobalBatchSampler`: global batches filled up to a token budget, deterministic and resumable.

Every rank builds the same sampler and gets the same list of document indices per step (the
planner then decides which rank runs what). Documents are visited in a seeded permutation per
epoch (``numpy`` PCG64 of ``(seed, epoch)``: identical on every machine); a batch takes documents
in that order while the budget allows, at least one. Documents are truncated to ``max_seq_len``
tokens, and documents with fewer than ``min_seq_len`` tokens are skipped (a 1-token document has no
next-token target). A budget above the tokens of the whole corpus is refused at construction
(a batch would hold every document several times, and a huge one would cycle epochs for minutes
before the first step). ``state_dict()`` / ``load_state_dict()`` resume exactly where a run
stopped.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np


class GlobalBatchSampler:
    """Yields lists of document indices, each a global batch of <= ``tokens_per_batch`` tokens."""

    def __init__(self, lengths: Sequence[int], tokens_per_batch: int, *, seed: int = 0,
                 max_seq_len: Optional[int] = None, min_seq_len: int = 2,
                 shuffle: bool = True) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if max_seq_len is not None and max_seq_len < min_seq_len:
            raise ValueError(f"max_seq_len={max_seq_len} is below min_seq_len={min_seq_len}")
        if max_seq_len is not None and tokens_per_batch < max_seq_len:
            raise ValueError(f"tokens_per_batch={tokens_per_batch} is below "
                             f"max_seq_len={max_seq_len}: "
                             "the longest sequence would not fit a global batch")
        if tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch={tokens_per_batch} must be positive")
        self.tokens_per_batch = int(tokens_per_batch)
        self.max_seq_len = max_seq_len
        self.min_seq_len = int(min_seq_len)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.usable = np.flatnonzero(self.lengths >= self.min_seq_len)
        if len(self.usable) == 0:
            raise ValueError(f"no document has at least {self.min_seq_len} tokens")
        corpus = int(np.minimum(self.lengths[self.usable], max_seq_len or np.inf).sum())
        if self.tokens_per_batch > corpus:
            raise ValueError(
                f"a global batch of {self.tokens_per_batch} tokens needs more than the corpus "
                f"holds: {corpus} tokens in {len(self.usable)} usable documents (cut at "
                f"max_seq_len={max_seq_len}); every batch would repeat documents about "
                f"{self.tokens_per_batch / corpus:.1f} times: lower --global-batch-tokens to at "
                f"most {corpus} or use more data")
        self.epoch = 0
        self.position = 0
        self.batches = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self.usable
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        return self.usable[rng.permutation(len(self.usable))]

    def distinct_lengths(self) -> list[int]:
        """Every length a batch of this sampler can hold, once (its usable documents' sizes cut
        at ``max_seq_len``): the whole dataset's distribution at the cost of one pass over the
        size array, small enough for the planner (``vocabulary_lengths=`` of
        `deepspeed_plugin.initialize` and `DCPForwardBackward`)."""
        lengths = self.lengths[self.usable]
        if self.max_seq_len:
            lengths = np.minimum(lengths, self.max_seq_len)
        return [int(n) for n in np.unique(lengths)]

    def sequence_length(self, doc: int) -> int:
        """Tokens of document ``doc`` after truncation to ``max_seq_len``."""
        n = int(self.lengths[doc])
        return min(n, self.max_seq_len) if self.max_seq_len else n

    def next_batch(self) -> list[int]:
        """Document indices of the next global batch (advances the state)."""
        batch: list[int] = []
        total = 0
        while True:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            doc = int(self._order[self.position])
            n = self.sequence_length(doc)
            if batch and total + n > self.tokens_per_batch:
                break
            batch.append(doc)
            total += n
            self.position += 1
            if total >= self.tokens_per_batch:
                break
        self.batches += 1
        return batch

    def peek_batch(self) -> list[int]:
        """Document indices of the batch `next_batch` returns next, without advancing (a step
        plans the next batch ahead: `megatron_dcp.runtime.plan_ahead`)."""
        saved = (self.epoch, self.position, self.batches, self._order)
        try:
            return self.next_batch()
        finally:
            self.epoch, self.position, self.batches, self._order = saved

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the same batches (plain ints: JSON-safe)."""
        return {"epoch": self.epoch, "position": self.position, "batches": self.batches,
                "seed": self.seed, "tokens_per_batch": self.tokens_per_batch,
                "max_seq_len": self.max_seq_len, "num_documents": int(len(self.lengths))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; a state from a different dataset or budget is an error, not a silent change."""
        for key, mine in (("seed", self.seed), ("tokens_per_batch", self.tokens_per_batch),
                          ("max_seq_len", self.max_seq_len), ("num_documents",
                                                              int(len(self.lengths)))):
            if state.get(key) != mine:
                raise ValueError(f"sampler state has {key}={state.get(key)!r} but this run has "
                                 f"{mine!r}; "
                                 "resume with the same data and batch settings")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.batches = int(state["batches"])
        self._order = self._permutation(self.epoch)
