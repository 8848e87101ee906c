"""Megatron indexed datasets: ``PREFIX.bin`` (token ids) and ``PREFIX.idx`` (index), MMIDIDX v1.

Layout of ``.idx`` (all little-endian), the one Megatron-LM and megatron-core read and write:

====================  ===========================================================
``b"MMIDIDX\\0\\0"``   9-byte magic
``<Q`` version         1
``<B`` dtype code      1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
``<Q`` sequences       S
``<Q`` doc entries     D (= documents + 1: document_indices starts with 0)
int32[S]               sequence lengths (in tokens)
int64[S]               sequence pointers (byte offsets into ``.bin``)
int64[D]               document indices (sequence index where each document ends; first 0)
====================  ===========================================================

``.bin`` is the concatenation of every sequence's tokens in the dtype above. This writer puts
one sequence per document (Megatron's preprocess_data.py without sentence splitting); the reader
accepts any number of sequences per document and reads sequences.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Union

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def best_dtype(vocab_size: int) -> type:
    """Smallest unsigned dtype Megatron uses for ``vocab_size`` tokens."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Streams documents to ``PREFIX.bin`` and writes ``PREFIX.idx`` on ``finalize()``.

    Use as a context manager, or call ``add_document`` then ``finalize`` yourself.
    """

    def __init__(self, prefix: str, dtype: Union[type, np.dtype] = np.uint16) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} is not one of the MMIDIDX dtypes "
                             f"{sorted(map(str, CODE_OF_DTYPE))}")
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        self._bin = open(prefix + ".bin", "wb")
        self._lengths: list[int] = []
        self._finalized = False

    def add_document(self, ids: Iterable[int]) -> None:
        """Append one document (one sequence) of token ids."""
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError("a document must be a 1-D sequence of token ids, got shape "
                             f"{array.shape}")
        if array.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if array.min() < info.min or array.max() > info.max:
                raise ValueError(f"token ids {array.min()}..{array.max()} do not fit dtype "
                                 f"{self.dtype}")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(array.size))

    def finalize(self) -> None:
        """Close ``.bin`` and write ``.idx``."""
        if self._finalized:
            return
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        doc_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self.prefix + ".idx", "wb") as idx:
            idx.write(MAGIC)
            idx.write(struct.pack("<Q", VERSION))
            idx.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            idx.write(struct.pack("<Q", len(lengths)))
            idx.write(struct.pack("<Q", len(doc_indices)))
            idx.write(lengths.tobytes(order="C"))
            idx.write(pointers.tobytes(order="C"))
            idx.write(doc_indices.tobytes(order="C"))
        self._finalized = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.finalize()


class IndexedDataset:
    """Memory-mapped reader of ``PREFIX.bin``/``PREFIX.idx``: ``ds[i]`` is sequence ``i``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.exists(path):
                raise FileNotFoundError(f"indexed dataset file {path} does not exist (--data-path "
                                        f"{prefix})")
        with open(idx_path, "rb") as f:
            magic = f.read(len(MAGIC))
            if magic != MAGIC:
                raise ValueError(f"{idx_path}: not a Megatron MMIDIDX index (header {magic!r})")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != VERSION:
                raise ValueError(f"{idx_path}: index version {version} is not supported (expected "
                                 f"{VERSION})")
            (code,) = struct.unpack("<B", f.read(1))
            if code not in DTYPE_CODES:
                raise ValueError(f"{idx_path}: unknown dtype code {code}")
            self.dtype = np.dtype(DTYPE_CODES[code])
            (num_sequences,) = struct.unpack("<Q", f.read(8))
            (num_doc_entries,) = struct.unpack("<Q", f.read(8))
            offset = f.tell()
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(index, dtype=np.int32, count=num_sequences,
                                              offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, dtype=np.int64, count=num_sequences,
                                               offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, dtype=np.int64, count=num_doc_entries,
                                              offset=offset)
        self._index = index
        size = os.path.getsize(bin_path)
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if size else np.zeros(0, np.uint8)
        if num_sequences:
            last = int(self.sequence_lengths[-1]) * self.dtype.itemsize
            end = int(self.sequence_pointers[-1]) + last
            if end > size:
                raise ValueError(f"{bin_path} is truncated: the index needs {end} bytes, the file "
                                 f"has {size}")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def lengths(self) -> np.ndarray:
        """Token count of every sequence."""
        return self.sequence_lengths

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``i`` (a read-only view)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range: the dataset {self.prefix} has "
                             f"{len(self)}")
        n = int(self.sequence_lengths[i])
        length = n - offset if length is None else min(length, n - offset)
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=max(length, 0), offset=start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)
