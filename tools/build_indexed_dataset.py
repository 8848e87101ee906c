"""Build a Megatron indexed dataset (PREFIX.bin / PREFIX.idx) from text or jsonl, byte-tokenized.

  python tools/build_indexed_dataset.py --input docs.jsonl --output-prefix data/my_corpus
  python tools/build_indexed_dataset.py --input book.txt --output-prefix data/book   # paragraphs
  python tools/build_indexed_dataset.py --embedded --output-prefix data/pystdlib  # embedded corpus
  python tools/build_indexed_dataset.py --input sft.jsonl --output-prefix data/sft \\
      --prompt-key prompt --response-key response   # + data/sft_mask.bin/.idx: a loss mask

With --prompt-key/--response-key each jsonl line is one document, its prompt's text then its
response's (EOD appended), and a loss mask is written beside it: PREFIX_mask.bin/.idx, one uint8
per token, 0 over the prompt (not trained as targets), 1 over the response and its EOD. The
examples train on the masked targets only (docs/USAGE.md, "Loss masks").

Train on it with ``examples/pretrain.py --data-path data/my_corpus``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np

from megatron_dcp.progress import Progress
from megatron_dcp.data import (ByteTokenizer, IndexedDatasetWriter, best_dtype,
                               embedded_corpus_texts, encode_pair, mask_prefix, read_documents,
                               read_jsonl_fields)
from megatron_dcp.data.loss_mask import mask_files


def main(argv=None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="jsonl(.gz) or text files; jsonl by extension")
    src.add_argument("--embedded", action="store_true",
                     help="the embedded corpus (megatron_dcp/data/corpus)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--json-key", default=None,
                   help="field of each jsonl object holding the text (default: text)")
    p.add_argument("--prompt-key", default=None, metavar="FIELD",
                   help="with --response-key: the jsonl field of each document's prompt, "
                   "masked out of the loss (PREFIX_mask.bin/.idx: 0 over its tokens)")
    p.add_argument("--response-key", default=None, metavar="FIELD",
                   help="with --prompt-key: the jsonl field of each document's response, "
                   "trained (mask 1 over its tokens and the EOD)")
    p.add_argument("--no-eod", action="store_true", help="do not append the end-of-document token")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already at PREFIX.bin/.idx (refused without it)")
    args = p.parse_args(argv)
    _check_args(p, args)
    masked = args.prompt_key is not None
    tokenizer = ByteTokenizer()
    start = time.time()
    try:
        docs, tokens, trained = _write(args, tokenizer)
    except (OSError, ValueError) as err:
        written = " and ".join(f"{prefix}.bin/.idx" for prefix in
                               [args.output_prefix] + [mask_prefix(args.output_prefix)] * masked)
        print(f"error: {err}; nothing written to {written}", file=sys.stderr)
        return 1
    if not masked:  # a mask left from an earlier build would mask these new documents
        for stale in mask_files(args.output_prefix):
            os.remove(stale)
            print(f"removed {stale}: the loss mask of the dataset this one replaces")
    mask = f", loss mask {mask_prefix(args.output_prefix)}.bin/.idx ({trained} tokens " \
        f"trained as targets)" if masked else ""
    print(f"wrote {args.output_prefix}.bin/.idx: {docs} documents, {tokens} tokens{mask} "
          f"in {time.time() - start:.1f}s")
    return 0


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The refusals at parse time (``p.error``): the output prefix, what exists there, the
    inputs, and --prompt-key/--response-key (both, jsonl inputs, not with --json-key)."""
    if (args.prompt_key is None) != (args.response_key is None):
        given = "--prompt-key" if args.prompt_key is not None else "--response-key"
        missing = "--response-key" if args.prompt_key is not None else "--prompt-key"
        p.error(f"argument {given}: needs {missing} too (a document is a prompt, masked, and "
                "a response, trained)")
    masked = args.prompt_key is not None
    if masked and args.embedded:
        p.error("argument --prompt-key: the embedded corpus has no prompts; give --input "
                "FILE.jsonl")
    if masked and args.json_key is not None:
        p.error("argument --json-key: not with --prompt-key/--response-key (they name the "
                "fields of a document)")
    plain = [path for path in args.input or ()
             if not path.removesuffix(".gz").endswith((".jsonl", ".json"))]
    if masked and plain:
        p.error(f"argument --prompt-key: {', '.join(plain)} is not jsonl (.jsonl/.json, "
                "optionally .gz): only jsonl documents have prompt and response fields")
    prefix = args.output_prefix
    if not os.path.basename(prefix) or os.path.isdir(prefix):  # DIR/ would write DIR/.bin
        p.error(f"argument --output-prefix: {prefix!r} names a directory; give a path PREFIX "
                f"for PREFIX.bin and PREFIX.idx, such as {os.path.join(prefix, 'corpus')}")
    blocker = _file_above(prefix)
    if blocker:
        p.error(f"argument --output-prefix: {blocker!r} is a file, not a directory; give a "
                f"prefix in a directory")
    existing = [prefix + s for s in (".bin", ".idx") if os.path.exists(prefix + s)]
    existing += mask_files(prefix)
    if existing and not args.overwrite:
        p.error(f"argument --output-prefix: {' and '.join(existing)} already exist; add "
                f"--overwrite to replace that dataset, or give another prefix")
    missing = [path for path in args.input or () if not os.path.isfile(path)]
    if missing:
        p.error(f"input file(s) not found: {', '.join(missing)}")


def _write(args: argparse.Namespace, tokenizer: ByteTokenizer) -> tuple[int, int, int]:
    """Write the dataset (and its loss mask with --prompt-key); returns (documents, tokens,
    tokens trained as targets). The writers rename their files over PREFIX.bin/.idx (and
    PREFIX_mask.bin/.idx) only when every document is in: a failure leaves a dataset already
    at PREFIX as it was."""
    masked = args.prompt_key is not None
    docs = tokens = trained = 0
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(IndexedDatasetWriter(args.output_prefix,
                                                          best_dtype(tokenizer.vocab_size)))
        masks = stack.enter_context(IndexedDatasetWriter(mask_prefix(args.output_prefix),
                                                         np.uint8)) if masked else None
        with Progress("documents") as bar:
            for ids, mask in _documents(args, tokenizer):
                writer.add_document(ids)
                if masks is not None:
                    masks.add_document(mask)
                    trained += int(mask[1:].sum())  # the first token is no target
                docs += 1
                tokens += len(ids)
                bar.update(label=f"{tokens} tokens")
        if docs == 0:  # a 0-document dataset fails later, far from its cause
            raise ValueError("no documents in " + (", ".join(args.input or ["the corpus"]))
                             + " (empty files, or only blank lines)")
    return docs, tokens, trained


def _documents(args: argparse.Namespace, tokenizer: ByteTokenizer):
    """(token ids, loss mask or None) of every document of the inputs, in order."""
    eod = not args.no_eod
    if args.prompt_key is not None:
        for path in args.input:
            for prompt, response in read_jsonl_fields(path, (args.prompt_key,
                                                             args.response_key)):
                yield encode_pair(tokenizer, prompt, response, append_eod=eod)
        return
    sources = [embedded_corpus_texts()] if args.embedded else [
        read_documents(path, args.json_key or "text") for path in args.input]
    for texts in sources:
        for text in texts:
            yield tokenizer.encode(text, append_eod=eod), None


def _file_above(prefix: str) -> str:
    """The first existing non-directory among ``prefix``'s parent folders, or ``""``."""
    folder = os.path.dirname(os.path.abspath(prefix))
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder if folder and not os.path.isdir(folder) else ""


if __name__ == "__main__":
    sys.exit(main())
