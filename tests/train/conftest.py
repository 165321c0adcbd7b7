"""Fixtures for end-to-end trainer tests: a small real dataset (the first 120 KJV chapters) built once."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from k3train.data.corpus import DEFAULT_CORPUS, read_documents, write_text_corpus
from k3train.data.prepare import prepare
from k3train.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    docs = [x.text for x in itertools.islice(read_documents(DEFAULT_CORPUS), 120)]
    write_text_corpus(docs, d / "kjv120.txt")
    prefix = d / "kjv120_text_document"
    prepare([d / "kjv120.txt"], load_tokenizer(DEFAULT_TOKENIZER), prefix)
    return prefix
