#!/usr/bin/env python
"""Tokenize text into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx / PREFIX.meta.json).

Inputs (any number, concatenated in order):
  *.jsonl[.gz]  one JSON object per line, the document in field --json-key (default "text")
  *.txt[.gz]    documents separated by a line that is exactly "<|endofdoc|>"; a file without such a line is
                one document
Every document is stored as one sequence with the tokenizer's EOS appended.

Examples:
  python tools/prepare_data.py --shipped-corpus --output-prefix data_cache/corpus_text_document   # same as:
  python tools/prepare_data.py --input k3train/data/assets/kjv.txt.gz \\
      --tokenizer k3train/data/assets/tokenizer.json --output-prefix data_cache/corpus_text_document
  # re-train the shipped tokenizer (then prepare, if --output-prefix is given too):
  python tools/prepare_data.py --train-tokenizer --input k3train/data/assets/kjv.txt.gz \\
      --tokenizer k3train/data/assets/tokenizer.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3train.data.corpus import DEFAULT_CORPUS, DataError  # noqa: E402
from k3train.data.tokenizer import DEFAULT_TOKENIZER, DEFAULT_VOCAB_SIZE  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", metavar="FILE", help="input .jsonl[.gz] / .txt[.gz] files")
    ap.add_argument("--tokenizer", help="tokenizer.json to use (or to write with --train-tokenizer)")
    ap.add_argument("--shipped-corpus", action="store_true",
                    help=f"defaults: --input {DEFAULT_CORPUS.relative_to(ROOT)} --tokenizer {DEFAULT_TOKENIZER.relative_to(ROOT)}")
    ap.add_argument("--output-prefix", help="write PREFIX.bin / PREFIX.idx / PREFIX.meta.json")
    ap.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on the inputs first")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="vocabulary size for --train-tokenizer")
    ap.add_argument("--json-key", default="text", help="document field of .jsonl inputs")
    ap.add_argument("--skip-empty", action="store_true", help="drop empty documents instead of failing")
    ap.add_argument("--batch-size", type=int, default=256, help="documents per tokenizer batch")
    a = ap.parse_args(argv)
    if a.shipped_corpus:
        a.input = a.input or [str(DEFAULT_CORPUS)]
        a.tokenizer = a.tokenizer or str(DEFAULT_TOKENIZER)
    if not a.input or not a.tokenizer:
        ap.error("--input and --tokenizer are required (or --shipped-corpus)")
    if not a.train_tokenizer and not a.output_prefix:
        ap.error("nothing to do: give --output-prefix and/or --train-tokenizer")

    from k3train.data.prepare import prepare, train_tokenizer

    try:
        if a.train_tokenizer:
            t0 = time.perf_counter()
            tok = train_tokenizer(a.input, a.tokenizer, a.vocab_size, a.json_key, a.skip_empty)
            print(f"trained {tok} in {time.perf_counter() - t0:.1f}s")
        if a.output_prefix:
            t0 = time.perf_counter()
            info = prepare(a.input, a.tokenizer, a.output_prefix, a.json_key, a.skip_empty, a.batch_size)
            print(f"wrote {a.output_prefix}.bin/.idx: {info.num_documents} documents, {info.num_tokens} tokens "
                  f"({info.dtype.__name__}) in {time.perf_counter() - t0:.1f}s")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
