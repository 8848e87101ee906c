"""Reading documents from jsonl (optionally gzip-compressed) and plain text files."""

from __future__ import annotations

import gzip
import json
from typing import Iterator, Sequence


def _open_bytes(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line; a line that is not UTF-8 raises naming file, line
    and byte offset in the line (a bare ``UnicodeDecodeError`` names neither)."""
    with _open_bytes(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8").replace("\r\n", "\n")  # as text mode
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} "
                                 f"at column {e.start + 1}); convert the file to UTF-8") from None


def read_jsonl(path: str, key: str = "text") -> Iterator[str]:
    """Yield ``obj[key]`` of every non-empty line; a bad line (not UTF-8, not JSON, no such
    string field) raises naming file and line number."""
    for (text,) in read_jsonl_fields(path, (key,)):
        yield text


def read_jsonl_fields(path: str, keys: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """Yield the string fields ``keys`` of every non-empty line (a prompt and its response:
    ``dcp-build-dataset --prompt-key/--response-key``); a bad line (not UTF-8, not JSON, a field
    missing or not a string) raises naming file, line and field."""
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        for key in keys:
            if not isinstance(obj, dict) or key not in obj:
                raise ValueError(f"{path}:{lineno}: no {key!r} field in this JSON line")
            if not isinstance(obj[key], str):
                raise ValueError(f"{path}:{lineno}: field {key!r} is {type(obj[key]).__name__}, "
                                 "not a string")
        yield tuple(obj[key] for key in keys)


def read_text_documents(path: str) -> Iterator[str]:
    """Documents of a plain text file: paragraphs separated by one or more blank lines."""
    paragraph: list[str] = []
    for _, line in _lines(path):
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
