"""Megatron indexed datasets: ``PREFIX.bin`` (token ids) and ``PREFIX.idx`` (index), MMIDIDX v1.

The layout of ``.idx`` and the reader of its header are `megatron_dcp.plan.idx_format` (the
planner reads lengths from it without numpy). ``.bin`` is the concatenation of every sequence's
tokens in the index's dtype. This writer puts one sequence per document (Megatron's
preprocess_data.py without sentence splitting); the reader accepts any number of sequences per
document and reads sequences.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Iterable, Optional, Union

import numpy as np

from megatron_dcp.plan.idx_format import HEADER_BYTES, pack_header, read_header

DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
TOKEN_DTYPE_CODES = {code for code, dtype in DTYPE_CODES.items() if np.dtype(dtype).kind in "iu"}
"""The dtype codes a token dataset may have: integers. MMIDIDX also names float32/float64 (for
other payloads); read as tokens, their ids are truncated (1.7 trains as 1), so every reader
refuses them and the writer does not write them."""


def dtype_problem(idx_path: str, code: int) -> str:
    """Why the index ``idx_path`` of dtype ``code`` cannot hold token ids (``""`` if it can)."""
    if code in TOKEN_DTYPE_CODES:
        return ""
    name = np.dtype(DTYPE_CODES[code]).name if code in DTYPE_CODES else "unknown"
    return (f"{idx_path}: dtype code {code} ({name}) is not an integer type; a token dataset "
            "holds integer ids (read as tokens, 1.7 would train as 1): rebuild it with integer "
            "ids (dcp-build-dataset, or Megatron-LM's preprocess_data.py)")


def best_dtype(vocab_size: int) -> type:
    """Smallest unsigned dtype Megatron uses for ``vocab_size`` tokens."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Streams documents to ``PREFIX.bin`` and writes ``PREFIX.idx`` on ``finalize()``.

    Use as a context manager, or call ``add_document`` then ``finalize`` (or ``abort``)
    yourself. Everything is written under temporary names beside the target and renamed over
    ``PREFIX.bin``/``PREFIX.idx`` only by ``finalize``: a build that raises (the context manager
    aborts it) leaves a previous dataset at ``PREFIX`` untouched and nothing half-written.
    """

    def __init__(self, prefix: str, dtype: Union[type, np.dtype] = np.uint16) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} is not one of the MMIDIDX dtypes "
                             f"{sorted(map(str, CODE_OF_DTYPE))}")
        if CODE_OF_DTYPE[self.dtype] not in TOKEN_DTYPE_CODES:  # every reader refuses it
            raise ValueError(f"dtype {self.dtype} is not an integer type: a token dataset holds "
                             "integer ids (use best_dtype(vocab_size), e.g. uint16)")
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        # the process id keeps two concurrent builds of one prefix from sharing a temporary file
        self._partial = f"{prefix}.partial-{os.getpid()}"
        self._bin = open(self._partial + ".bin", "wb")
        self._lengths: list[int] = []
        self._done = False

    def add_document(self, ids: Iterable[int]) -> None:
        """Append one document (one sequence) of token ids."""
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError("a document must be a 1-D sequence of token ids, got shape "
                             f"{array.shape}")
        if array.size and array.dtype.kind not in "iub":
            raise ValueError(f"token ids must be integers, got {array.dtype} values")
        if array.size:
            info = np.iinfo(self.dtype)
            if array.min() < max(info.min, 0) or array.max() > info.max:
                raise ValueError(f"token ids {array.min()}..{array.max()} do not fit dtype "
                                 f"{self.dtype} (ids run from 0)")
        if array.size > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {array.size} tokens exceeds the index's int32 "
                             "lengths")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(array.size))

    def finalize(self) -> None:
        """Write ``.idx``, make both files durable, then rename them over the target."""
        if self._done:
            return
        try:
            self._write_index()
        except BaseException:
            self.abort()
            raise
        # .bin first: between the two renames the new .bin meets the old .idx, a pair that
        # IndexedDataset's size and pointer checks reject rather than read
        os.replace(self._partial + ".bin", self.prefix + ".bin")
        os.replace(self._partial + ".idx", self.prefix + ".idx")
        _sync_directory(os.path.dirname(os.path.abspath(self.prefix)))
        self._done = True

    def _write_index(self) -> None:
        _close_durably(self._bin)
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        doc_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self._partial + ".idx", "wb") as idx:
            idx.write(pack_header(CODE_OF_DTYPE[self.dtype], len(lengths), len(doc_indices)))
            idx.write(lengths.tobytes(order="C"))
            idx.write(pointers.tobytes(order="C"))
            idx.write(doc_indices.tobytes(order="C"))
            _close_durably(idx)

    def abort(self) -> None:
        """Drop what was written; a dataset already at ``PREFIX`` stays as it was."""
        if self._done:
            return
        self._bin.close()
        for suffix in (".bin", ".idx"):
            try:
                os.remove(self._partial + suffix)
            except FileNotFoundError:
                pass
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _close_durably(handle) -> None:
    """Flush ``handle`` to the disk (not only to the page cache), then close it."""
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()


def _sync_directory(path: str) -> None:
    """fsync a directory so that renames in it survive a power loss (POSIX; a no-op elsewhere)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class IndexedDataset:
    """Memory-mapped reader of ``PREFIX.bin``/``PREFIX.idx``: ``ds[i]`` is sequence ``i``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.exists(path):
                raise FileNotFoundError(f"indexed dataset file {path} does not exist (--data-path "
                                        f"{prefix})")
        header = read_header(idx_path)
        problem = dtype_problem(idx_path, header.dtype_code)
        if problem:
            raise ValueError(problem)
        self.dtype = np.dtype(DTYPE_CODES[header.dtype_code])
        num_sequences, num_doc_entries = header.sequences, header.doc_entries
        offset = HEADER_BYTES
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
        _check_index(idx_path, bin_path, size, self.sequence_lengths, self.sequence_pointers,
                     self.document_indices, self.dtype.itemsize)
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if size else np.zeros(0, np.uint8)

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

    def check_vocabulary(self, vocab_size: int, cache: bool = True) -> None:
        """Every token id in ``[0, vocab_size)``, else a ValueError naming the first document,
        position and id outside it (an id past the vocabulary fails only when its document is
        sampled, as an ``IndexError`` deep inside a task; a negative one indexes the embedding
        from its end, or fails inside the step). One pass over the ``.bin`` in chunks; the ids'
        range is then cached (`token_range`), so a second open costs a checksum of the index."""
        low, high = self.token_range(cache=cache)
        if low is None or (low >= 0 and high < vocab_size):
            return
        tokens = self._tokens()
        for start in range(0, len(tokens), _CHECK_CHUNK):
            chunk = tokens[start:start + _CHECK_CHUNK]
            if int(chunk.max()) < vocab_size and int(chunk.min()) >= 0:
                continue
            at = start + int(np.argmax((chunk >= vocab_size) | (chunk < 0)))
            byte = at * self.dtype.itemsize
            seq = int(np.searchsorted(self.sequence_pointers, byte, side="right")) - 1
            pos = (byte - int(self.sequence_pointers[seq])) // self.dtype.itemsize
            bad = int(tokens[at])
            why = ("no tokenizer makes a negative id: the .bin is corrupt or not token ids; "
                   "rebuild the dataset" if bad < 0 else "built with another tokenizer? rebuild "
                   "the dataset, or use a model with a larger vocabulary")
            raise ValueError(f"{self.prefix}.bin: document {seq} has token id {bad} at position "
                             f"{pos}, outside the model's vocabulary of {vocab_size} (ids "
                             f"0..{vocab_size - 1}; {why})")

    def _tokens(self) -> np.ndarray:
        return np.frombuffer(self._bin, dtype=self.dtype,
                             count=len(self._bin) // self.dtype.itemsize)

    def token_range(self, cache: bool = True) -> tuple[Optional[int], Optional[int]]:
        """The smallest and largest token id of the ``.bin`` (None, None when it is empty).

        Scanned with numpy over the memory map, `_CHECK_CHUNK` tokens at a time (memory stays
        bounded whatever the size), with a line of progress on stderr every few seconds once a
        scan is slow. The result is cached in a small JSON file under the user's cache folder
        (`range_cache_dir`), keyed by a checksum of the ``.idx`` and the ``.bin``'s size and
        modification time: not beside the dataset, whose folder may be read-only or shared, and
        where a file the user did not write has no place. A cache that cannot be read or written
        is ignored."""
        key = _range_key(self.prefix) if cache else None
        cached = _read_range(key) if key else None
        if cached is not None:
            return cached
        tokens = self._tokens()
        low = high = None
        started = shown = time.monotonic()
        for start in range(0, len(tokens), _CHECK_CHUNK):
            chunk = tokens[start:start + _CHECK_CHUNK]
            lo, hi = int(chunk.min()), int(chunk.max())
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
            now = time.monotonic()
            if now - shown >= _PROGRESS_S:
                shown = now
                done = min(start + _CHECK_CHUNK, len(tokens))
                print(f"checking the token ids of {self.prefix}.bin: {100 * done // len(tokens)}% "
                      f"({done * self.dtype.itemsize / 1e9:.1f} of "
                      f"{len(tokens) * self.dtype.itemsize / 1e9:.1f} GB, {now - started:.0f} s)",
                      file=sys.stderr, flush=True)
        if key:
            _write_range(key, self.prefix, low, high)
        return low, high


_CHECK_CHUNK = 1 << 24
"""Sequences or tokens checked per vectorised pass (bounds the temporary arrays at a few hundred
MB)."""
_PROGRESS_S = 5.0
"""Seconds between two progress lines of a token-id scan (none for a faster scan)."""
_RANGE_CACHE_VERSION = 1


def range_cache_dir() -> str:
    """Where `IndexedDataset.token_range` caches a dataset's id range: ``$DCP_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/megatron_dcp/token-ranges``, else ``~/.cache/megatron_dcp/token-ranges``."""
    if os.environ.get("DCP_CACHE_DIR"):
        return os.environ["DCP_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_dcp", "token-ranges")


def _range_key(prefix: str) -> Optional[str]:
    """The cache key of ``prefix``: blake2b of the ``.idx`` (read in 16 MB blocks) with the
    ``.bin``'s size and mtime (ns); None when a file cannot be read."""
    digest = hashlib.blake2b(digest_size=20)
    try:
        stat = os.stat(prefix + ".bin")
        with open(prefix + ".idx", "rb") as idx:
            for block in iter(lambda: idx.read(1 << 24), b""):
                digest.update(block)
    except OSError:
        return None
    digest.update(f"|{stat.st_size}|{stat.st_mtime_ns}|{_RANGE_CACHE_VERSION}".encode())
    return digest.hexdigest()


def _read_range(key: str) -> Optional[tuple[Optional[int], Optional[int]]]:
    """The cached range of ``key``, or None (absent, unreadable, or not what this writes)."""
    try:
        with open(os.path.join(range_cache_dir(), key + ".json"), encoding="utf-8") as handle:
            entry = json.load(handle)
        low, high = entry["min"], entry["max"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if entry.get("key") != key or not all(v is None or type(v) is int for v in (low, high)) \
            or (low is None) != (high is None):
        return None
    return low, high


def _write_range(key: str, prefix: str, low: Optional[int], high: Optional[int]) -> None:
    """Cache ``key``'s range (written whole, then renamed: a reader never sees half a file);
    a folder that cannot be written is skipped without a word (the next open scans again)."""
    folder = range_cache_dir()
    path = os.path.join(folder, key + ".json")
    partial = f"{path}.partial-{os.getpid()}"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump({"key": key, "dataset": os.path.abspath(prefix), "min": low, "max": high},
                      handle)
        os.replace(partial, path)
    except OSError:
        try:
            os.remove(partial)
        except OSError:
            pass


def _check_index(idx_path: str, bin_path: str, bin_size: int, lengths: np.ndarray,
                 pointers: np.ndarray, doc_indices: np.ndarray, itemsize: int) -> None:
    """Every length, pointer and document index against each other and the ``.bin`` size.

    Sequences lie back to back from byte 0 (what Megatron's writers produce), so a corrupt
    length or pointer anywhere shows up as a gap or overlap instead of feeding the tokens of the
    next document. Raises `ValueError` naming the file and the first bad entry.
    """
    expected = 0  # byte where the next sequence must start
    for lo in range(0, len(lengths), _CHECK_CHUNK):
        n = lengths[lo:lo + _CHECK_CHUNK].astype(np.int64)
        p = pointers[lo:lo + _CHECK_CHUNK]
        bad = np.flatnonzero(n < 0)
        if bad.size:
            i = lo + int(bad[0])
            raise ValueError(f"{idx_path}: sequence {i} has a negative length {int(lengths[i])}")
        starts = np.empty_like(p)
        starts[0] = expected
        np.cumsum(n[:-1] * itemsize, out=starts[1:])
        starts[1:] += expected
        bad = np.flatnonzero(p != starts)
        if bad.size:
            i = lo + int(bad[0])
            what = "the previous sequence's end" if i else "0"
            raise ValueError(
                f"{idx_path}: sequence {i} starts at byte {int(pointers[i])}, expected "
                f"{int(starts[bad[0]])} ({what}): a length or pointer of the index is corrupt, "
                f"or its dtype code ({itemsize} bytes a token) is not the .bin's")
        expected = int(starts[-1]) + int(n[-1]) * itemsize
    if expected != bin_size:
        raise ValueError(f"{bin_path} has {bin_size} bytes, its index {idx_path} describes "
                         f"{expected}: the two files do not belong together (truncated, or "
                         "written by different builds)")
    if len(doc_indices) == 0 or doc_indices[0] != 0 or doc_indices[-1] != len(lengths):
        raise ValueError(f"{idx_path}: document indices must run from 0 to the sequence count "
                         f"{len(lengths)}, got {doc_indices[:1].tolist()}..."
                         f"{doc_indices[-1:].tolist()}")
    if len(doc_indices) > 1 and bool(np.any(np.diff(doc_indices) < 0)):
        i = int(np.flatnonzero(np.diff(doc_indices) < 0)[0]) + 1
        raise ValueError(f"{idx_path}: document index {i} ({int(doc_indices[i])}) is smaller than "
                         "the one before it")
