"""Megatron's indexed dataset index (``PREFIX.idx``, MMIDIDX version 1): its layout and the one
reader of it. Pure Python (no numpy): the planner reads a data set's lengths from it, and the
data layer's memory-mapped `megatron_dcp.data.indexed.IndexedDataset` reads its header here.

Layout (all little-endian), the one Megatron-LM and megatron-core read and write:

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
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
"""Bytes per token of every dtype code of the header (see the module doc)."""


class IndexHeader(NamedTuple):
    """What the header of a ``.idx`` announces."""

    dtype_code: int
    sequences: int
    doc_entries: int

    @property
    def size(self) -> int:
        """Bytes of the whole index: header, lengths, pointers, document indices."""
        return HEADER_BYTES + self.sequences * (4 + 8) + self.doc_entries * 8


def pack_header(dtype_code: int, sequences: int, doc_entries: int) -> bytes:
    """The header bytes of an index (what Megatron's writers put first)."""
    return MAGIC + struct.pack("<QBQQ", VERSION, dtype_code, sequences, doc_entries)


def read_header(path: str) -> IndexHeader:
    """The header of the index ``path``, checked: magic, version, dtype code, and a file at least
    as long as the header announces. `ValueError` naming the file and the fault (`OSError` as
    ``open`` raises it)."""
    with open(path, "rb") as handle:
        head = handle.read(HEADER_BYTES)
    if head[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{path}: not a Megatron MMIDIDX index (header {head[:len(MAGIC)]!r})")
    if len(head) < HEADER_BYTES:
        raise ValueError(f"{path} is truncated: {len(head)} bytes, shorter than the "
                         f"{HEADER_BYTES}-byte header")
    version, code, sequences, doc_entries = struct.unpack("<QBQQ", head[len(MAGIC):])
    if version != VERSION:
        raise ValueError(f"{path}: index version {version} is not supported (expected "
                         f"{VERSION})")
    if code not in ITEMSIZE:
        raise ValueError(f"{path}: unknown dtype code {code}")
    header = IndexHeader(code, sequences, doc_entries)
    size = os.path.getsize(path)
    if size < header.size:
        raise ValueError(f"{path} is truncated: its header announces {sequences} sequences and "
                         f"{doc_entries} document entries ({header.size} bytes), the file has "
                         f"{size} bytes")
    return header


def read_lengths(path: str) -> list[int]:
    """The sequence lengths of the index ``path`` (`read_header`'s errors)."""
    header = read_header(path)
    with open(path, "rb") as handle:
        handle.seek(HEADER_BYTES)
        data = handle.read(4 * header.sequences)
    return list(struct.unpack(f"<{header.sequences}i", data))


def write_lengths(path: str, lengths: "list[int] | tuple[int, ...]", dtype_code: int = 4) -> None:
    """Write an index of ``lengths``, one sequence per document, sequences back to back in a
    ``.bin`` of ``dtype_code`` tokens (for tests and tools that need only lengths)."""
    count = len(lengths)
    itemsize = ITEMSIZE[dtype_code]
    pointers, offset = [], 0
    for n in lengths:
        pointers.append(offset)
        offset += itemsize * n
    with open(path, "wb") as handle:
        handle.write(pack_header(dtype_code, count, count + 1))
        handle.write(struct.pack(f"<{count}i", *lengths))
        handle.write(struct.pack(f"<{count}q", *pointers))
        handle.write(struct.pack(f"<{count + 1}q", *range(count + 1)))
