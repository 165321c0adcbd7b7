"""Tokenize raw-text files into a Megatron indexed dataset (the library side of ``tools/prepare_data.py``)."""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from k3train.data.corpus import DataError, Document, read_documents
from k3train.data.dataset import IndexInfo, write_indexed_dataset
from k3train.data.tokenizer import (DEFAULT_VOCAB_SIZE, SpecialTokens, TextTokenizer, load_tokenizer,
                                    save_tokenizer, train_bpe_tokenizer)

logger = logging.getLogger(__name__)


def iter_documents(inputs: Sequence[str | Path], json_key: str = "text", skip_empty: bool = False
                   ) -> Iterator[Document]:
    """All documents of ``inputs`` in order (formats: :func:`k3train.data.corpus.read_documents`)."""
    if not inputs:
        raise DataError("no input files given")
    for p in inputs:  # check every file up front: fail before minutes of work, not after
        if not Path(p).is_file():
            raise DataError(f"input file not found: {p}")
    for p in inputs:
        yield from read_documents(p, json_key=json_key, skip_empty=skip_empty)


def _batches(docs: Iterator[Document], n: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for d in docs:
        batch.append(d)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_documents(docs: Iterator[Document], tok: TextTokenizer, batch_size: int = 256
                       ) -> Iterator[np.ndarray]:
    """Encode documents in batches (parallel in the Rust tokenizer). A document whose text contains the
    literal text of a special token (which the tokenizer would turn into that token) is an error."""
    special = np.array(sorted(tok.special_ids))
    for batch in _batches(docs, batch_size):
        for d, ids in zip(batch, tok.encode_batch([d.text for d in batch])):
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size == 0:
                raise DataError(f"{d.source}: document encodes to no tokens")
            hit = np.isin(arr, special)
            if hit.any():
                name = tok.decode([int(arr[np.argmax(hit)])])
                raise DataError(f"{d.source}: document contains the special token text {name!r}")
            yield arr


def prepare(inputs: Sequence[str | Path], tokenizer: str | Path | TextTokenizer, output_prefix: str | Path,
            json_key: str = "text", skip_empty: bool = False, batch_size: int = 256,
            special: SpecialTokens | None = None) -> IndexInfo:
    """Tokenize ``inputs`` into ``output_prefix.{bin,idx,meta.json}`` (EOS after every document); ``special``
    names the tokenizer's special tokens (default: the shipped names)."""
    tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer, special)
    docs = iter_documents(inputs, json_key, skip_empty)
    meta = {"tokenizer": str(tok.path), "tokenizer_sha256": tok.sha256, "inputs": [str(p) for p in inputs]}
    return write_indexed_dataset(output_prefix, tokenize_documents(docs, tok, batch_size), tok.eos_id,
                                 tok.vocab_size, meta)


def train_tokenizer(inputs: Sequence[str | Path], output: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    json_key: str = "text", skip_empty: bool = False,
                    special: SpecialTokens | None = None) -> TextTokenizer:
    """Train the byte-level BPE on the documents of ``inputs`` and save it to ``output``. It may have fewer ids
    than ``vocab_size`` (the caller compares ``.vocab_size``: :func:`k3train.data.tokenizer.vocab_shortfall`)."""
    texts = (d.text for d in iter_documents(inputs, json_key, skip_empty))
    save_tokenizer(train_bpe_tokenizer(texts, vocab_size, special=special), output)
    return load_tokenizer(output, special)
