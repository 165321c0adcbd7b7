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
  # bring your own tokenizer.json: name its special tokens (the same names go in the run config's data section,
  # data.bos_token / eos_token / pad_token, and their ids in model.bos_token_id / eos_token_id / pad_token_id)
  python tools/prepare_data.py --input my.jsonl --tokenizer my/tokenizer.json --bos-token '<s>' \\
      --eos-token '</s>' --pad-token '<pad>' --output-prefix data_cache/my_text_document

Multimodal (images / video interleaved with text, k3train/data/multimodal): --multimodal DIR reads a
Megatron-Energon WebDataset (DIR/.nv-meta + tar shards of <key>.json + <key>.<n>.png) and writes PREFIX.bin/.idx
(tokens, each media expanded to its placeholder tokens) + PREFIX.media.bin/.media.npy (resized pixels):
  python tools/prepare_data.py --shipped-multimodal --output-prefix data_cache/mm   # builds the shipped corpus
      # (shards in data_cache/mm_wds/, tokenizer k3train/data/assets/tokenizer-vl.json) and prepares it; same as
  python tools/prepare_data.py --multimodal data_cache/mm_wds --tokenizer k3train/data/assets/tokenizer-vl.json \
      --media-token '<|media_pad|>' --output-prefix data_cache/mm
A run on it: data.format=multimodal, data.path=PREFIX, data.tokenizer=...tokenizer-vl.json,
data.media_placeholder_token='<|media_pad|>', model.media_placeholder_token_id=4096, model.vocab_size>=4099.

Chat data for supervised fine-tuning (k3train/data/chat): --chat reads JSONL conversations ({"messages": [...]}
per line), renders each with the tokenizer's chat template (tokenizer_config.json / chat_template.jinja beside it,
or --chat-template FILE) and writes PREFIX.bin/.idx (tokens, EOS after every conversation) + PREFIX.mask.bin/.idx
(1 on the assistant's tokens); a run on it: data.format=chat. A checkpoint's tiktoken tokenizer works as it is:
  k3train prepare-data --chat --input chats.jsonl --tokenizer HF_DIR/tiktoken.model --bos-token '[BOS]' \
      --eos-token '[EOS]' --pad-token '[PAD]' --output-prefix data_cache/my_chat

A trained tokenizer can have fewer ids than --vocab-size (BPE stops when no pair of tokens occurs twice): a
notice says how many it has (--exact-vocab-size makes that an error).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3train.data.chat.prepare import prepare_chat  # noqa: E402
from k3train.data.corpus import DEFAULT_CORPUS, DataError  # noqa: E402
from k3train.data.multimodal.prepare import prepare_multimodal  # noqa: E402
from k3train.data.multimodal.shipped import build_shipped_shards  # noqa: E402
from k3train.data.multimodal.vl_tokenizer import MEDIA_PAD, VL_TOKENIZER  # noqa: E402
from k3train.data.prepare import prepare, train_tokenizer  # noqa: E402
from k3train.data.tokenizer import (BOS, DEFAULT_TOKENIZER, DEFAULT_VOCAB_SIZE, EOS, PAD,  # noqa: E402
                                    SpecialTokens, load_tokenizer, vocab_shortfall)
from k3train.runtime.bad_input import report_bad_input  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", metavar="FILE", help="input .jsonl[.gz] / .txt[.gz] files")
    ap.add_argument("--tokenizer", help="tokenizer.json or tiktoken.model to use (or the tokenizer.json to write with "
                    "--train-tokenizer)")
    ap.add_argument("--shipped-corpus", action="store_true",
                    help=f"defaults: --input {DEFAULT_CORPUS.relative_to(ROOT)} --tokenizer {DEFAULT_TOKENIZER.relative_to(ROOT)}")
    ap.add_argument("--output-prefix", help="write PREFIX.bin / PREFIX.idx / PREFIX.meta.json")
    ap.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on the inputs first")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="vocabulary size for --train-tokenizer")
    ap.add_argument("--exact-vocab-size", action="store_true",
                    help="with --train-tokenizer: fail when the corpus cannot reach --vocab-size")
    ap.add_argument("--bos-token", default=BOS, help="the tokenizer's BOS token (config: data.bos_token)")
    ap.add_argument("--eos-token", default=EOS, help="the tokenizer's EOS token, appended to every document "
                    "(config: data.eos_token)")
    ap.add_argument("--pad-token", default=PAD, help="the tokenizer's padding token (config: data.pad_token)")
    ap.add_argument("--media-token", default="", help="a vision placeholder token, if the tokenizer has one "
                    "(config: data.media_placeholder_token)")
    ap.add_argument("--multimodal", metavar="DIR", help="an Energon WebDataset of interleaved image/video + text "
                    "samples (needs --media-token)")
    ap.add_argument("--shipped-multimodal", action="store_true", help="build the shipped multimodal corpus into "
                    "PREFIX_wds/ and prepare it (defaults: tokenizer-vl.json, --media-token '<|media_pad|>')")
    ap.add_argument("--max-media-pixels", type=int, default=3584 * 3584,
                    help="largest image / frame (height*width px, after resizing to multiples of 28) to accept")
    ap.add_argument("--chat", action="store_true", help="the inputs are JSONL conversations: write tokens + the "
                    "assistant-only loss mask (data.format=chat)")
    ap.add_argument("--chat-template", metavar="FILE", help="with --chat: a jinja chat template to use instead of the "
                    "tokenizer's")
    ap.add_argument("--json-key", default="text", help="document field of .jsonl inputs")
    ap.add_argument("--skip-empty", action="store_true", help="drop empty documents instead of failing")
    ap.add_argument("--batch-size", type=int, default=256, help="documents per tokenizer batch")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    try:
        if a.multimodal or a.shipped_multimodal:
            prepare_multimodal_main(ap, a)
        elif a.chat:
            prepare_chat_main(ap, a)
        else:
            prepare_text_main(ap, a)
    except DataError as e:
        return report_bad_input(e)
    return 0


def prepare_text_main(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.shipped_corpus:
        a.input = a.input or [str(DEFAULT_CORPUS)]
        a.tokenizer = a.tokenizer or str(DEFAULT_TOKENIZER)
    if not a.input or not a.tokenizer:
        ap.error("--input and --tokenizer are required (or --shipped-corpus)")
    if not a.train_tokenizer and not a.output_prefix:
        ap.error("nothing to do: give --output-prefix and/or --train-tokenizer")

    special = SpecialTokens(a.bos_token, a.eos_token, a.pad_token, a.media_token)
    if a.train_tokenizer:
        t0 = time.perf_counter()
        tok = train_tokenizer(a.input, a.tokenizer, a.vocab_size, a.json_key, a.skip_empty, special)
        print(f"trained {tok} in {time.perf_counter() - t0:.1f}s")
        short = vocab_shortfall(a.vocab_size, tok.vocab_size)
        if short and a.exact_vocab_size:
            raise DataError(short)
        if short:
            print(f"k3train: notice: {short}", file=sys.stderr, flush=True)
    if a.output_prefix:
        t0 = time.perf_counter()
        info = prepare(a.input, a.tokenizer, a.output_prefix, a.json_key, a.skip_empty, a.batch_size, special)
        print(f"wrote {a.output_prefix}.bin/.idx: {info.num_documents} documents, {info.num_tokens} tokens "
              f"({info.dtype.__name__}) in {time.perf_counter() - t0:.1f}s")


def prepare_chat_main(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if not a.input or not a.tokenizer or not a.output_prefix:
        ap.error("--chat needs --input, --tokenizer and --output-prefix")
    if a.train_tokenizer:
        ap.error("--chat uses the checkpoint's tokenizer (no --train-tokenizer)")
    tok = load_tokenizer(a.tokenizer, SpecialTokens(a.bos_token, a.eos_token, a.pad_token, a.media_token))
    t0 = time.perf_counter()
    info, stats = prepare_chat(a.input, tok, a.output_prefix, a.chat_template)
    dt = time.perf_counter() - t0
    print(f"wrote {a.output_prefix}.bin/.idx + .mask.bin/.mask.idx: {stats.conversations} conversations, "
          f"{stats.tokens} tokens ({stats.assistant_tokens} assistant tokens, "
          f"{stats.assistant_tokens / max(stats.tokens, 1):.1%}) in {dt:.1f}s ({stats.tokens / max(dt, 1e-9):,.0f} "
          "tokens/s)")


def prepare_multimodal_main(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if not a.output_prefix:
        ap.error("--multimodal / --shipped-multimodal need --output-prefix")
    if a.shipped_multimodal:
        a.tokenizer = a.tokenizer or str(VL_TOKENIZER)
        a.media_token = a.media_token or MEDIA_PAD
    if not a.tokenizer or not a.media_token:
        ap.error("--multimodal needs --tokenizer and --media-token (the tokenizer's media placeholder)")
    t0 = time.perf_counter()
    if a.shipped_multimodal:
        a.multimodal = a.multimodal or f"{a.output_prefix}_wds"
        n = build_shipped_shards(a.multimodal)
        print(f"wrote the shipped multimodal corpus: {n} samples in {a.multimodal} "
              f"({time.perf_counter() - t0:.1f}s)")
    tok = load_tokenizer(a.tokenizer, SpecialTokens(a.bos_token, a.eos_token, a.pad_token, a.media_token))
    t0 = time.perf_counter()
    info, n_media = prepare_multimodal(a.multimodal, tok, a.output_prefix, a.max_media_pixels)
    print(f"wrote {a.output_prefix}.bin/.idx + .media.bin/.media.npy: {info.num_documents} documents, "
          f"{info.num_tokens} tokens, {n_media} media in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
