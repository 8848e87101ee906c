"""Reading documents from jsonl (optionally gzip-compressed) and plain text files."""

from __future__ import annotations

import gzip
import json
from typing import Iterator


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def read_jsonl(path: str, key: str = "text") -> Iterator[str]:
    """Yield ``obj[key]`` of every non-empty line; a bad line raises naming file and line number."""
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or key not in obj:
                raise ValueError(f"{path}:{lineno}: no {key!r} field in this JSON line")
            if not isinstance(obj[key], str):
                raise ValueError(f"{path}:{lineno}: field {key!r} is {type(obj[key]).__name__}, "
                                 "not a string")
            yield obj[key]


def read_text_documents(path: str) -> Iterator[str]:
    """Documents of a plain text file: paragraphs separated by one or more blank lines."""
    with _open_text(path) as f:
        paragraph: list[str] = []
        for line in f:
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "".join(paragraph)
                paragraph = []
        if paragraph:
            yield "".join(paragraph)


def read_documents(path: str, key: str = "text") -> Iterator[str]:
    """Documents of ``path``: jsonl for ``.jsonl``/``.json`` (optionally ``.gz``), else plain
    text paragraphs."""
    plain = path[:-3] if path.endswith(".gz") else path
    if plain.endswith((".jsonl", ".json")):
        return read_jsonl(path, key)
    return read_text_documents(path)
