"""The tiktoken tokenizer read from a Kimi checkpoint's files (a ranks file and tokenizer_config.json built here):
its ids equal tiktoken's own encoding with Kimi's pattern and those special tokens, decode(encode(s)) == s over a
corpus with Chinese, code and emoji, and what cannot be read is one line."""
from __future__ import annotations

import base64
import itertools
import json
import subprocess
import sys

import pytest
import tiktoken

from chat_helpers import KIMI_NAMES, KIMI_SPECIALS, byte_level_ranks, write_kimi_tokenizer
from k3train.data.corpus import DEFAULT_CORPUS, DataError, read_documents
from k3train.data.special_tokens import SpecialTokens
from k3train.data.tiktoken_tokenizer import KIMI_PATTERN, MAX_RUN_CHARS, TiktokenTokenizer, split_for_tiktoken
from k3train.data.tokenizer import load_tokenizer, tokenizer_sha256

MIXED = [
    "天地玄黄，宇宙洪荒。日月盈昃，辰宿列张。The quick brown fox's den isn't here; they'll say we'd gone.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # 🐍\n\n\tx = {'a': [1, 2, 3]}\r\n",
    "Emoji 🎉🚀👩‍👩‍👧‍👦 and flags 🇯🇵🇫🇷; accents: naïve café Ærøskøbing; numbers 1234567 3.14159 -42",
    "ＵＮＩＣＯＤＥ　全角 ｶﾀｶﾅ ひらがな 한국어 العربية עברית Ελληνικά кириллица  \u200b zero-width",
    "    leading spaces\n\n\n\ntrailing spaces    \n" + "x" * 50 + " " * 30 + "END",
]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_tok")
    path = write_kimi_tokenizer(d)
    return path, load_tokenizer(path, SpecialTokens(*KIMI_NAMES))


def _reference(path) -> tiktoken.Encoding:
    """tiktoken's own encoding with Kimi's pattern and the checkpoint's special tokens (as its code builds it)."""
    ranks = {}
    for line in path.read_text().splitlines():
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    base = len(ranks)
    named = {base + k: v for k, v in KIMI_SPECIALS.items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + 256)}
    return tiktoken.Encoding(name="ref", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_ids_equal_tiktoken_and_round_trip(kimi):
    path, tok = kimi
    ref = _reference(path)
    corpus = MIXED + [d.text for d in itertools.islice(read_documents(DEFAULT_CORPUS), 3)]
    n_tokens = n_chars = 0
    for s in corpus:
        ids = tok.encode(s)
        assert ids == ref.encode(s, allowed_special="all"), s[:40]
        assert tok.decode(ids) == s
        n_tokens, n_chars = n_tokens + len(ids), n_chars + len(s)
    assert tok.encode_batch(corpus) == [ref.encode(s, allowed_special="all") for s in corpus]
    print(f"\ntiktoken parity: {len(corpus)} texts, {n_chars} chars, {n_tokens} tokens, all ids equal, all round trips")
    # special tokens: Kimi's names at their ids, reserved names elsewhere, the config's names resolved
    base = len(byte_level_ranks())
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (base, base + 1, base + 255, base + 256)
    assert tok.encode("<|im_end|>") == [base + 2] and tok.token_to_id("<|reserved_token_%d|>" % (base + 5)) == base + 5
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


def test_offsets_cover_each_character(kimi):
    _, tok = kimi
    s = MIXED[0] + MIXED[2]
    ids, spans = tok.encode_offsets(s)
    assert len(ids) == len(spans) and spans[0, 0] == 0 and spans[-1, 1] == len(s)
    assert (spans[1:, 0] >= spans[:-1, 0]).all() and (spans[:, 1] > spans[:, 0]).all()


def test_long_runs_are_cut_where_the_checkpoint_cuts_them():
    s = "a" * (2 * MAX_RUN_CHARS + 10) + " b"
    pieces = list(split_for_tiktoken(s))
    assert "".join(pieces) == s and [len(p) for p in pieces] == [MAX_RUN_CHARS, MAX_RUN_CHARS, 12]
    assert list(split_for_tiktoken("short")) == ["short"] and list(split_for_tiktoken("")) == [""]


def test_hash_covers_the_special_tokens(kimi, tmp_path):
    path, tok = kimi
    assert tokenizer_sha256(path) == tok.sha256 and tokenizer_sha256(path.parent) == tok.sha256
    other = write_kimi_tokenizer(tmp_path / "o")
    cfg = json.loads((tmp_path / "o" / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"][str(len(byte_level_ranks()) + 30)] = {"content": "<|new|>", "special": True}
    (tmp_path / "o" / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert tokenizer_sha256(other) != tok.sha256


@pytest.mark.parametrize("how, needle", [
    ("unknown class", "tokenizer class 'tokenization_other.SentencePieceTokenizer' is not a tiktoken tokenizer"),
    ("missing special", "data.eos_token: tokenizer"),
    ("bad ranks line", "tiktoken.model:3: not a tiktoken ranks line"),
])
def test_bad_tokenizer_is_one_line(tmp_path, how, needle):
    cls = "SentencePieceTokenizer" if how == "unknown class" else "TikTokenTokenizer"
    path = write_kimi_tokenizer(tmp_path, tokenizer_class=cls)
    names = SpecialTokens(*KIMI_NAMES)
    if how == "missing special":
        names = SpecialTokens("[BOS]", "<|endoftext|>", "[PAD]")
    if how == "bad ranks line":
        lines = path.read_text().splitlines()
        lines[2] = "not-base64!! x"
        path.write_text("\n".join(lines))
    with pytest.raises(DataError) as e:
        TiktokenTokenizer(path, names)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_no_network_and_no_remote_code(kimi):
    """Loading reads only the two files: no tiktoken download (no cache dir touched), no tokenization_kimi.py."""
    path, _ = kimi
    code = ("import os, socket, sys\n"
            "def no(*a, **k): raise SystemExit('network used')\n"
            "socket.socket.connect = no\n"
            "os.environ['TIKTOKEN_CACHE_DIR'] = '/nonexistent/tiktoken-cache'\n"
            "from k3train.data.tokenizer import load_tokenizer\n"
            "from k3train.data.special_tokens import SpecialTokens\n"
            f"t = load_tokenizer({str(path)!r}, SpecialTokens('[BOS]', '[EOS]', '[PAD]'))\n"
            "assert t.decode(t.encode('ok 好')) == 'ok 好'\n"
            "assert not any('tokenization_kimi' in m for m in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
