"""Broken datasets fail early with one DataError line naming the file (no numpy/torch traceback later)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from k3train.data.corpus import DataError, write_text_corpus
from k3train.data.dataset import (build_gpt_datasets, check_metadata, check_split_sizes, sample_tokens,
                                  validate_indexed_dataset)
from k3train.data.tokenizer import file_sha256
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
    # 40 documents, 99,1,0: the valid split gets round(0.99*40)=40..40, no document. Fatal only when read.
    with pytest.raises(DataError, match=r"data.split='99,1,0': the valid split .* \(0 of 40\) = 0 tokens"):
        build_gpt_datasets(p, tok, 32, 1, "99,1,0", {"train": 10, "valid": None})
    built = build_gpt_datasets(p, tok, 32, 1, "99,1,0", {"train": 10})
    assert sorted(built) == ["train"]
    with pytest.raises(DataError, match=r"the train split .* fewer than one sample of seq_len\+1=100001"):
        check_split_sizes(validate_indexed_dataset(p), "99,1,0", 100_000, ["train"])
    with pytest.raises(DataError, match="gives the valid split weight 0, but the run reads it"):
        check_split_sizes(validate_indexed_dataset(p), "100,0,0", 32, ["train", "valid"])
    for bad in ("a,b", "98,2", "1,-1,1"):
        with pytest.raises(DataError, match="data.split: cannot parse"):
            build_gpt_datasets(p, tok, 32, 1, bad, {"train": 10})


def test_unread_split_leaves_train_samples_unchanged(small_prefix, tmp_path, tok):
    """Building only the train split (what the loader does) gives the same documents and samples as building
    every split: the split matrix comes from the full split string either way."""
    p = copy_dataset(small_prefix, tmp_path / "u")
    both = build_gpt_datasets(p, tok, 32, 7, "90,10,0", {"train": 50, "valid": None})
    only = build_gpt_datasets(p, tok, 32, 7, "90,10,0", {"train": 50})
    assert sorted(both) == ["train", "valid"] and sorted(only) == ["train"]
    assert len(both["train"]) == len(only["train"])
    for i in range(0, len(only["train"]), 5):
        assert (sample_tokens(both["train"], i) == sample_tokens(only["train"], i)).all()


def test_prepare_records_the_tokenizer(small_prefix, tok):
    meta = json.loads(Path(str(small_prefix) + ".meta.json").read_text())
    assert meta["tokenizer_sha256"] == file_sha256(tok.path) == tok.sha256
    assert meta["vocab_size"] == tok.vocab_size == 4096 and meta["eos_id"] == tok.eos_id


def test_dataset_without_recorded_hash_warns_once(small_prefix, tmp_path, tok, caplog):
    p = copy_dataset(small_prefix, tmp_path / "h")
    mp = Path(str(p) + ".meta.json")
    meta = json.loads(mp.read_text())
    del meta["tokenizer_sha256"]
    mp.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="k3train.data.dataset"):
        check_metadata(p, tok)
        check_metadata(p, tok)  # the loader's later call stays quiet
    assert [r.getMessage() for r in caplog.records if "cannot verify" in r.getMessage()] == [
        f"{mp} has no tokenizer_sha256: cannot verify that data.tokenizer {tok.path} made this dataset"]
    p2 = copy_dataset(small_prefix, tmp_path / "h2")
    Path(str(p2) + ".meta.json").unlink()  # no metadata at all: a warning too, not an error
    with caplog.at_level(logging.WARNING, logger="k3train.data.dataset"):
        check_metadata(p2, tok)
    assert any("is missing: cannot verify" in r.getMessage() for r in caplog.records)
    meta["vocab_size"] = 5000  # a recorded value that differs is an error even without the hash
    mp.write_text(json.dumps(meta))
    with pytest.raises(DataError, match="data.tokenizer: .*vocab_size=5000"):
        check_metadata(p, tok)


def test_split_ranges_match_megatron():
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)

    from k3train.data.dataset import split_document_ranges

    for split in ("98,2,0", "99,1,0", "100,0,0", "90,5,5", "0,1,0", "1,1,1", "969,30,1", "0.7,0.2,0.1", "3,0,7"):
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        for n in (1, 3, 40, 120, 1189, 10_007):
            want = [None if m is None else (int(round(m[0] * n)), int(round(m[1] * n))) for m in matrix]
            assert split_document_ranges(n, split) == want, (split, n)
