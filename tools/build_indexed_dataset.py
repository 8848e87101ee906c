"""Build a Megatron indexed dataset (PREFIX.bin / PREFIX.idx) from text or jsonl, byte-tokenized.

  python tools/build_indexed_dataset.py --input docs.jsonl --output-prefix data/my_corpus
  python tools/build_indexed_dataset.py --input book.txt --output-prefix data/book   # paragraphs
  python tools/build_indexed_dataset.py --embedded --output-prefix data/pystdlib  # embedded corpus

Train on it with ``examples/pretrain.py --data-path data/my_corpus``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from megatron_dcp.progress import Progress
from megatron_dcp.data import (ByteTokenizer, IndexedDatasetWriter, best_dtype,
                               embedded_corpus_texts, read_documents)


def main(argv=None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="jsonl(.gz) or text files; jsonl by extension")
    src.add_argument("--embedded", action="store_true",
                     help="the embedded corpus (megatron_dcp/data/corpus)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--json-key", default="text", help="field of each jsonl object holding the text")
    p.add_argument("--no-eod", action="store_true", help="do not append the end-of-document token")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already at PREFIX.bin/.idx (refused without it)")
    args = p.parse_args(argv)

    prefix = args.output_prefix
    if not os.path.basename(prefix) or os.path.isdir(prefix):  # DIR/ would write DIR/.bin
        p.error(f"argument --output-prefix: {prefix!r} names a directory; give a path PREFIX "
                f"for PREFIX.bin and PREFIX.idx, such as {os.path.join(prefix, 'corpus')}")
    blocker = _file_above(prefix)
    if blocker:
        p.error(f"argument --output-prefix: {blocker!r} is a file, not a directory; give a "
                f"prefix in a directory")
    existing = [prefix + s for s in (".bin", ".idx") if os.path.exists(prefix + s)]
    if existing and not args.overwrite:
        p.error(f"argument --output-prefix: {' and '.join(existing)} already exist; add "
                f"--overwrite to replace that dataset, or give another prefix")
    missing = [path for path in args.input or () if not os.path.isfile(path)]
    if missing:
        p.error(f"input file(s) not found: {', '.join(missing)}")
    tokenizer = ByteTokenizer()
    start = time.time()
    docs = tokens = 0
    try:
        # the writer renames its files over PREFIX.bin/.idx only when every document is in: a
        # failure below leaves a dataset already at PREFIX as it was
        with IndexedDatasetWriter(args.output_prefix,
                                  best_dtype(tokenizer.vocab_size)) as writer:
            sources = [embedded_corpus_texts()] if args.embedded else [
                read_documents(path, args.json_key) for path in args.input]
            with Progress("documents") as bar:
                for texts in sources:
                    for text in texts:
                        ids = tokenizer.encode(text, append_eod=not args.no_eod)
                        writer.add_document(ids)
                        docs += 1
                        tokens += len(ids)
                        bar.update(label=f"{tokens} tokens")
            if docs == 0:  # a 0-document dataset fails later, far from its cause
                raise ValueError("no documents in " + (", ".join(args.input or ["the corpus"]))
                                 + " (empty files, or only blank lines)")
    except (OSError, ValueError) as err:
        print(f"error: {err}; nothing written to {args.output_prefix}.bin/.idx", file=sys.stderr)
        return 1
    print(f"wrote {args.output_prefix}.bin/.idx: {docs} documents, {tokens} tokens "
          f"in {time.time() - start:.1f}s")
    return 0


def _file_above(prefix: str) -> str:
    """The first existing non-directory among ``prefix``'s parent folders, or ``""``."""
    folder = os.path.dirname(os.path.abspath(prefix))
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder if folder and not os.path.isdir(folder) else ""


if __name__ == "__main__":
    sys.exit(main())
