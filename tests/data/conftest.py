"""Shared fixtures of the data tests: the shipped tokenizer and a small real dataset (KJV Genesis)."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from k3train.data.corpus import DEFAULT_CORPUS, read_documents, write_text_corpus
from k3train.data.prepare import prepare
from k3train.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

N_DOCS = 40  # Genesis 1-40, ~40k tokens


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer(DEFAULT_TOKENIZER)


@pytest.fixture(scope="session")
def genesis_docs() -> list[str]:
    return [d.text for d in itertools.islice(read_documents(DEFAULT_CORPUS), N_DOCS)]


@pytest.fixture(scope="session")
def small_prefix(tmp_path_factory, tok, genesis_docs) -> Path:
    d = tmp_path_factory.mktemp("small")
    write_text_corpus(genesis_docs, d / "genesis.txt")
    prefix = d / "genesis_text_document"
    prepare([d / "genesis.txt"], tok, prefix)
    return prefix
