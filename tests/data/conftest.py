"""Shared fixtures of the data tests: the shipped tokenizer and a small real dataset (KJV Genesis)."""
from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest

from k3train.config import Config
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


def copy_dataset(prefix: Path, dst_dir: Path) -> Path:
    """Copy PREFIX.{bin,idx,meta.json} into ``dst_dir`` (a fresh place, so no index cache exists yet)."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copy(str(prefix) + ext, dst_dir / (prefix.name + ext))
    return dst_dir / prefix.name


def make_cfg(prefix: Path, gbs: int = 8, mbs: int = 2, seq_len: int = 32, steps: int = 20, seed: int = 1234,
             split: str = "90,10,0") -> Config:
    cfg = Config()
    cfg.model.vocab_size = 4096
    cfg.data.path = str(prefix)
    cfg.data.split = split
    cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = seq_len, gbs, mbs
    cfg.train.steps, cfg.train.seed = steps, seed
    return cfg
