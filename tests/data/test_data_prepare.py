"""Corpus reading, tokenizer, prepare_data: tokens and document boundaries survive the round trip."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from k3train.data.corpus import DEFAULT_CORPUS, DOC_SEPARATOR, DataError, read_documents, write_text_corpus
from k3train.data.dataset import read_documents_back, validate_indexed_dataset
from k3train.data.prepare import prepare, train_tokenizer
from k3train.data.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import prepare_data  # noqa: E402  (tools/prepare_data.py)


def test_shipped_corpus_and_tokenizer(tok, genesis_docs):
    assert tok.vocab_size == 4096 and (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert genesis_docs[0].startswith("Genesis 1\n\n1 In the beginning God created the heaven and the earth.")
    assert genesis_docs[1].startswith("Genesis 2\n")
    for d in genesis_docs[:5]:
        ids = tok.encode(d)
        assert tok.decode(ids) == d  # byte-level BPE is lossless
        assert not set(ids) & tok.special_ids
    assert len(tok.encode(genesis_docs[0])) < len(genesis_docs[0].encode()) / 3  # real merges were learned
    n = sum(1 for _ in read_documents(DEFAULT_CORPUS))
    assert n == 1189  # chapters of the King James Bible


def test_txt_and_jsonl_formats(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text(f"first doc\nline two\n\n{DOC_SEPARATOR}\n\nsecond  doc\n{DOC_SEPARATOR}\nthird\n")
    assert [d.text for d in read_documents(p)] == ["first doc\nline two", "second  doc", "third"]
    q = tmp_path / "one.txt.gz"
    with gzip.open(q, "wt") as f:
        f.write("a whole file\n\nis one document\n")
    assert [d.text for d in read_documents(q)] == ["a whole file\n\nis one document"]
    j = tmp_path / "b.jsonl"
    j.write_text(json.dumps({"text": "x y", "id": 1}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    assert [d.text for d in read_documents(j)] == ["x y", "z"]
    docs = ["alpha\n\nbeta", "gamma"]
    write_text_corpus(docs, tmp_path / "w.txt.gz")
    assert [d.text for d in read_documents(tmp_path / "w.txt.gz")] == docs


def test_prepare_round_trip(tmp_path, tok):
    txt = tmp_path / "a.txt"
    txt.write_text(f"In the beginning.\n{DOC_SEPARATOR}\nAnd the earth was without form.\n")
    jl = tmp_path / "b.jsonl.gz"
    with gzip.open(jl, "wt") as f:
        f.write(json.dumps({"text": "Let there be light: and there was light."}) + "\n")
        f.write(json.dumps({"text": "x"}) + "\n")
    texts = ["In the beginning.", "And the earth was without form.", "Let there be light: and there was light.", "x"]
    prefix = tmp_path / "out" / "ds"
    info = prepare([txt, jl], tok, prefix)
    assert info.num_documents == 4 and info.dtype == np.uint16
    back = list(read_documents_back(prefix))  # through megatron's IndexedDataset
    assert len(back) == 4
    for text, arr in zip(texts, back):
        assert arr.tolist() == tok.encode(text) + [tok.eos_id]  # exactly one EOS, at the end
        assert tok.decode(arr[:-1].tolist()) == text
    assert info.num_tokens == sum(len(a) for a in back)
    meta = json.loads(Path(str(prefix) + ".meta.json").read_text())
    assert meta["tokenizer_sha256"] == tok.sha256 and meta["documents"] == 4


def test_prepare_errors(tmp_path, tok):
    with pytest.raises(DataError, match="input file not found: .*nope.txt"):
        prepare([tmp_path / "nope.txt"], tok, tmp_path / "o")
    bad = tmp_path / "empty_doc.txt"
    bad.write_text(f"fine\n{DOC_SEPARATOR}\n\n   \n{DOC_SEPARATOR}\nalso fine\n")
    with pytest.raises(DataError, match=r"empty_doc.txt:3: empty document"):
        prepare([bad], tok, tmp_path / "o")
    info = prepare([bad], tok, tmp_path / "o2", skip_empty=True)
    assert info.num_documents == 2
    sp = tmp_path / "special.txt"
    sp.write_text("hello <|eos|> world\n")
    with pytest.raises(DataError, match=r"special.txt:1: .*special token text '<\|eos\|>'"):
        prepare([sp], tok, tmp_path / "o")
    j = tmp_path / "k.jsonl"
    j.write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match=r"k.jsonl:1: no 'text' field"):
        prepare([j], tok, tmp_path / "o")
    j.write_text('{"text": "x"\n')
    with pytest.raises(DataError, match=r"k.jsonl:1: malformed JSON"):
        prepare([j], tok, tmp_path / "o")
    assert not Path(str(tmp_path / "o") + ".bin").exists()  # nothing half-written is left behind


def test_cli(tmp_path, capsys, tok):
    src = tmp_path / "c.txt"
    src.write_text("one\n" + DOC_SEPARATOR + "\ntwo\n")
    rc = prepare_data.main(["--input", str(src), "--tokenizer", tok.path, "--output-prefix", str(tmp_path / "c")])
    assert rc == 0 and validate_indexed_dataset(tmp_path / "c").num_documents == 2
    # --shipped-corpus fills in the shipped tokenizer (and the shipped corpus when --input is absent)
    rc = prepare_data.main(["--shipped-corpus", "--input", str(src), "--output-prefix", str(tmp_path / "d")])
    assert rc == 0 and (tmp_path / "d.idx").read_bytes() == (tmp_path / "c.idx").read_bytes()
    rc = prepare_data.main(["--input", str(tmp_path / "missing.jsonl"), "--tokenizer", tok.path,
                            "--output-prefix", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "missing.jsonl" in err and "Traceback" not in err


def test_train_tokenizer(tmp_path, genesis_docs):
    src = tmp_path / "g.txt"
    write_text_corpus(genesis_docs[:3], src)
    t = train_tokenizer([src], tmp_path / "tok.json", vocab_size=400)
    assert t.vocab_size == 400 and (t.bos_id, t.eos_id, t.pad_id) == (0, 1, 2)
    s = "And God said, Let there be light \u00e9\u4e2d"  # unseen bytes still encode (byte fallback)
    assert t.decode(t.encode(s)) == s
    again = train_tokenizer([src], tmp_path / "tok2.json", vocab_size=400)
    assert again.sha256 == t.sha256  # training is deterministic
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "none.json")


def test_kjv_conversion():
    from k3train.data.make_kjv import kjv_chapters_from_brs

    raw = ("Ge1:1 In the beginning God created the heaven and the earth.\n"
           "Ge1:2 And the earth was without form, and void.\n"
           "Ge2:1 Thus the heavens and the earth were finished.\n"
           "Rev22:21 The grace of our Lord Jesus Christ be with you all. Amen.\n")
    assert kjv_chapters_from_brs(raw) == [
        "Genesis 1\n\n1 In the beginning God created the heaven and the earth.\n"
        "2 And the earth was without form, and void.",
        "Genesis 2\n\n1 Thus the heavens and the earth were finished.",
        "Revelation 22\n\n21 The grace of our Lord Jesus Christ be with you all. Amen.",
    ]
    with pytest.raises(DataError, match="line 1: not a 'BookC:V text' verse line"):
        kjv_chapters_from_brs("Xx1:1 nope\n")
