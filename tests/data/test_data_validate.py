"""Broken datasets fail early with one DataError line naming the file (no numpy/torch traceback later)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from k3train.data.corpus import DataError, write_text_corpus
from k3train.data.dataset import build_gpt_datasets, validate_indexed_dataset
from k3train.data.prepare import prepare
from k3train.data.tokenizer import load_tokenizer
from data_helpers import copy_dataset


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_valid_dataset_passes(small_prefix, tok):
    info = validate_indexed_dataset(small_prefix, tok.vocab_size)
    assert info.num_documents == 40 and info.num_sequences == 40


def test_missing_files(small_prefix, tmp_path, tok):
    p = copy_dataset(small_prefix, tmp_path / "m")
    Path(str(p) + ".bin").unlink()
    with pytest.raises(DataError) as e:
        validate_indexed_dataset(p)
    assert "not found" in _one_line(e) and str(p) + ".bin" in _one_line(e)
    with pytest.raises(DataError, match="not found: .*nothing_here.idx"):
        build_gpt_datasets(tmp_path / "nothing_here", tok, 32, 1, "100,0,0", {"train": 10})


def test_truncated_bin(small_prefix, tmp_path, tok):
    p = copy_dataset(small_prefix, tmp_path / "t")
    b = Path(str(p) + ".bin")
    with open(b, "r+b") as f:
        f.truncate(b.stat().st_size - 2)  # one uint16 token short
    with pytest.raises(DataError) as e:
        build_gpt_datasets(p, tok, 32, 1, "100,0,0", {"train": 10})
    assert str(b) in _one_line(e) and "truncated" in _one_line(e)


def test_truncated_and_corrupt_idx(small_prefix, tmp_path):
    p = copy_dataset(small_prefix, tmp_path / "i")
    ip = Path(str(p) + ".idx")
    raw = ip.read_bytes()
    ip.write_bytes(raw[:-8])
    with pytest.raises(DataError) as e:
        validate_indexed_dataset(p)
    assert str(ip) in _one_line(e) and "truncated" in _one_line(e)
    ip.write_bytes(raw[:20])
    with pytest.raises(DataError, match="shorter than"):
        validate_indexed_dataset(p)
    ip.write_bytes(b"NOTANIDX!" + raw[9:])
    with pytest.raises(DataError, match="not a Megatron index"):
        validate_indexed_dataset(p)


def test_idx_from_another_dataset(small_prefix, tmp_path, tok, genesis_docs):
    other = tmp_path / "other"
    other.mkdir()
    write_text_corpus(genesis_docs[:3], other / "g.txt")
    prepare([other / "g.txt"], tok, other / "ds")
    p = copy_dataset(small_prefix, tmp_path / "x")
    shutil.copy(other / "ds.idx", str(p) + ".idx")  # .idx of a 3-document dataset next to a 40-document .bin
    with pytest.raises(DataError) as e:
        validate_indexed_dataset(p)
    assert str(p) + ".bin" in _one_line(e) and "another .bin" in _one_line(e)


def test_wrong_tokenizer(small_prefix, tmp_path, tok, genesis_docs):
    from k3train.data.prepare import train_tokenizer

    write_text_corpus(genesis_docs[:2], tmp_path / "g.txt")
    small = train_tokenizer([tmp_path / "g.txt"], tmp_path / "t.json", vocab_size=300)
    with pytest.raises(DataError, match=r"genesis_text_document.bin: token ids span .* 300 ids"):
        validate_indexed_dataset(small_prefix, small.vocab_size)
    # same vocabulary size, another tokenizer file: caught by the metadata that prepare wrote
    alt_path = tmp_path / "t2.json"
    alt_path.write_text(json.dumps(json.loads(Path(tok.path).read_text()), indent=2))
    alt = load_tokenizer(alt_path)
    with pytest.raises(DataError, match=r"meta.json: dataset was made with tokenizer_sha256"):
        build_gpt_datasets(small_prefix, alt, 32, 1, "100,0,0", {"train": 10})


def test_split_too_small(small_prefix, tmp_path, tok):
    p = copy_dataset(small_prefix, tmp_path / "s")
    with pytest.raises(DataError, match=r"data.split='99,1,0': the valid split .* 0 tokens"):
        build_gpt_datasets(p, tok, 32, 1, "99,1,0", {"train": 10})
    with pytest.raises(DataError, match="cannot parse"):
        build_gpt_datasets(p, tok, 32, 1, "a,b", {"train": 10})
