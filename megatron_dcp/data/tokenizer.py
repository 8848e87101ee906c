"""A byte-level tokenizer: self-contained, lossless, the same on every machine.

Token ids 0-255 are the UTF-8 bytes; 256 is end-of-document (EOD). ``vocab_size`` is 257.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as tokens plus one end-of-document token."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str, append_eod: bool = True) -> np.ndarray:
        """Token ids (``uint16``) of ``text``, with EOD appended unless ``append_eod`` is False."""
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
        if append_eod:
            ids = np.append(ids, np.uint16(self.eod))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; EOD becomes a newline, invalid UTF-8 is replaced."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eod:
                out += b"\n"
            elif 0 <= i < 256:
                out.append(i)
            else:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary "
                                 "(0..256)")
        return out.decode("utf-8", errors="replace")
