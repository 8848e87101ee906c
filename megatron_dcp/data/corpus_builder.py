"""Builds the embedded corpus ``corpus/pystdlib.jsonl.gz`` (run once; the file is committed).

The corpus is real English and Python text that needs no download: the docstrings of the Python
standard library (many short documents: functions and classes) plus the full source of a few of
its modules (few long documents). That mix gives the long-tailed length distribution that
variable-length training meets in practice: most documents are a few hundred bytes, a few are
tens of thousands. The Python standard library is distributed under the PSF License v2, which
permits redistribution with its notice (see corpus/README.md).

Usage: ``python -m megatron_dcp.data.corpus_builder [OUT]``. The file is committed so every machine
sees the same bytes; rebuilding on another Python version gives a different (still valid) corpus.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import sys
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__", "ensurepip",
             "turtledemo", "tkinter", "dist-packages"}
MIN_DOC_CHARS = 40
SOURCE_MIN_BYTES = 4_000
SOURCE_MAX_BYTES = 160_000
SOURCE_BUDGET_BYTES = 3_800_000  # raw; about 0.9 MB gzip-compressed
SOURCE_EVERY = 3  # take every third eligible module (alphabetical) until the budget is spent


def _python_files(root: str) -> list[str]:
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        found += [os.path.join(here, f) for f in sorted(files) if f.endswith(".py")]
    return found


def build_documents(stdlib: str | None = None) -> list[dict]:
    """Documents ``{"text", "source"}``: unique docstrings, then selected module sources."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    docs: list[dict] = []
    seen: set[str] = set()
    sources: list[tuple[str, str]] = []
    for path in _python_files(stdlib):
        rel = os.path.relpath(path, stdlib)
        try:
            text = Path(path).read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOC_CHARS and doc not in seen:
                    seen.add(doc)
                    docs.append({"text": doc, "source": rel})
        if SOURCE_MIN_BYTES <= len(text.encode()) <= SOURCE_MAX_BYTES:
            sources.append((rel, text))
    budget = SOURCE_BUDGET_BYTES
    for rel, text in sources[::SOURCE_EVERY]:
        size = len(text.encode())
        if size > budget:
            continue
        budget -= size
        docs.append({"text": text, "source": rel})
    return docs


def write_corpus(out: str, docs: list[dict]) -> None:
    """Gzip-compressed jsonl with a fixed mtime so the bytes are reproducible."""
    payload = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9,
                                               mtime=0) as gz:
        gz.write(payload)


if __name__ == "__main__":
    default = Path(__file__).parent / "corpus" / "pystdlib.jsonl.gz"
    target = sys.argv[1] if len(sys.argv) > 1 else str(default)
    documents = build_documents()
    write_corpus(target, documents)
    print(f"wrote {len(documents)} documents to {target} ({os.path.getsize(target)} bytes)")
