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


@pytest.fixture(scope="session")
def straight(corpus_prefix, tmp_path_factory) -> list[dict]:
    """One process, ``STRAIGHT_STEPS`` steps of the tiny config on ``FAST`` batches without interruption: the
    reference of test_train_e2e.py and test_resume_layouts.py (the same command in both, so it runs once)."""
    from train_helpers import FAST, STRAIGHT_STEPS, assert_ok, read_metrics, run_train  # noqa: PLC0415

    out = tmp_path_factory.mktemp("straight")
    assert_ok(run_train(["--config", "configs/tiny.yaml", f"--data.path={corpus_prefix}", f"--train.out_dir={out}",
                         f"--train.steps={STRAIGHT_STEPS}", *FAST, "--checkpoint.resume=none"]))
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(1, STRAIGHT_STEPS + 1))
    return got
