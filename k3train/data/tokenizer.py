"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``), trained offline on the shipped corpus.

The shipped ``assets/tokenizer.json`` has 4096 entries: ids 0, 1, 2 are ``<|bos|>``, ``<|eos|>``, ``<|pad|>``,
then the 256 byte symbols, then merges. Byte-level BPE without a normalizer is lossless:
``decode(encode(s)) == s`` for any string. Encoding adds no special tokens; the data pipeline appends EOS to
every document itself. Re-train with ``tools/prepare_data.py --train-tokenizer``.

Another ``tokenizer.json`` works when it names its special tokens: ``data.bos_token / eos_token / pad_token``
(default ``<|bos|>``, ``<|eos|>``, ``<|pad|>``; e.g. ``<s>``, ``</s>``, ``<pad>`` for a SentencePiece-style one)
and, for a vision tokenizer, ``data.media_placeholder_token``. :class:`SpecialTokens` carries those names.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import numpy as np

from k3train.data.corpus import ASSETS_DIR, DataError
from k3train.data.tiktoken_tokenizer import RANKS_NAME, TiktokenTokenizer, is_tiktoken_file, tiktoken_sha256
from k3train.data.tokenizer_config import TokenizerConfig, read_tokenizer_config
from k3train.data.special_tokens import BOS, EOS, PAD, SPECIAL_TOKENS, SpecialTokens, file_sha256  # noqa: F401 (re-exported)

DEFAULT_TOKENIZER = ASSETS_DIR / "tokenizer.json"
DEFAULT_VOCAB_SIZE = 4096


class TextTokenizer:
    """A ``tokenizer.json`` tokenizer (the other kind: :class:`k3train.data.tiktoken_tokenizer.TiktokenTokenizer`,
    the same interface). Thin wrapper over a ``tokenizers.Tokenizer`` with the special tokens the pipeline needs.

    Attributes: ``vocab_size`` (int, including special tokens), ``bos_id``, ``eos_id``, ``pad_id``, ``media_id``
    (None without a media placeholder), ``path`` and ``sha256`` (of the JSON file, used to tie a prepared dataset
    to its tokenizer).
    """

    kind = "tokenizer.json"

    def __init__(self, tok: Tokenizer, path: str = "<memory>", sha256: str = "",
                 special: SpecialTokens | None = None) -> None:
        self._tok = tok
        self.path = path
        self.sha256 = sha256
        self.special = special or SpecialTokens()
        ids = {}
        for key, name in self.special.named():
            i = tok.token_to_id(name)
            if i is None:
                raise DataError(f"{key}: tokenizer {path} has no special token {name!r}; set {key} to the name "
                                f"this tokenizer uses (e.g. '<s>'), or add the token when training it")
            ids[key] = i
        self.bos_id, self.eos_id, self.pad_id = ids["data.bos_token"], ids["data.eos_token"], ids["data.pad_token"]
        self.media_id: int | None = ids.get("data.media_placeholder_token")
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(ids.values())
        self.all_special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        # a tokenizer_config.json beside the file: the chat template and the token names it sees
        tc = read_tokenizer_config(path) if path != "<memory>" else TokenizerConfig()
        self.chat_template = tc.chat_template
        self.template_tokens = {"bos_token": self.special.bos, "eos_token": self.special.eos,
                                "pad_token": self.special.pad, **tc.named_tokens}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once (parallel in Rust)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[list[int], np.ndarray]:
        """``(ids, spans)``: spans ``[n, 2]`` of each token's characters in ``text``."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, name: str) -> int | None:
        return self._tok.token_to_id(name)

    def __repr__(self) -> str:
        return (f"TextTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, pad={self.pad_id})")


def load_tokenizer(path: str | Path = DEFAULT_TOKENIZER, special: SpecialTokens | None = None
                   ) -> TextTokenizer | TiktokenTokenizer:
    """Load a tokenizer whose special tokens are named ``special`` (default: the shipped names): a
    ``tokenizer.json``, or a tiktoken ranks file (``tiktoken.model``, with the ``tokenizer_config.json`` beside it;
    :mod:`k3train.data.tiktoken_tokenizer`). A directory means the ``tokenizer.json`` in it, else its
    ``tiktoken.model``. Raises :class:`DataError` naming the file when missing or malformed, or the key of a
    missing token."""
    p = resolve_tokenizer_path(path)
    if is_tiktoken_file(p):
        return TiktokenTokenizer(p, special)
    if not p.is_file():
        raise DataError(f"tokenizer file not found: {p} (train one with tools/prepare_data.py --train-tokenizer)")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
        raise DataError(f"cannot load tokenizer {p}: {str(e).splitlines()[0]}") from None
    return TextTokenizer(tok, str(p), file_sha256(p), special)


def resolve_tokenizer_path(path: str | Path) -> Path:
    """The tokenizer file ``path`` names (a directory: its ``tokenizer.json``, else its ``tiktoken.model``)."""
    p = Path(path)
    if p.is_dir():
        for name in ("tokenizer.json", RANKS_NAME):
            if (p / name).is_file():
                return p / name
    return p


def tokenizer_sha256(path: str | Path) -> str:
    """The hash a run fingerprint records for ``data.tokenizer``: the file's sha256 (a tiktoken ranks file: with the
    pattern and special tokens of its tokenizer_config.json, as :attr:`TiktokenTokenizer.sha256`); "" when missing."""
    p = resolve_tokenizer_path(path)
    if not p.is_file():
        return ""
    if is_tiktoken_file(p):
        try:
            return tiktoken_sha256(p)
        except DataError:
            return file_sha256(p)
    return file_sha256(p)


def load_config_tokenizer(cfg: Any) -> TextTokenizer | TiktokenTokenizer:
    """The tokenizer a run config names: ``data.tokenizer`` with the ``data.*_token`` names."""
    return load_tokenizer(cfg.data.tokenizer, SpecialTokens.from_config(cfg.data))


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
                        min_frequency: int = 2, special: SpecialTokens | None = None) -> Tokenizer:
    """Train a byte-level BPE on ``texts``. Special tokens get ids 0..2 (3 with a media placeholder); every byte
    is in the alphabet, so any text encodes without unknown tokens. The result can be SMALLER than
    ``vocab_size``: merges stop when no pair occurs ``min_frequency`` times (see :func:`vocab_shortfall`)."""
    names = [n for _, n in (special or SpecialTokens()).named()]
    if vocab_size < len(names) + 256:
        raise DataError(f"vocab_size={vocab_size} is too small: byte-level BPE needs >= "
                        f"{len(names) + 256} (specials + 256 bytes)")
    tok = Tokenizer(models.BPE())
    # No normalizer and no prefix space: encoding is exactly invertible.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=names,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def vocab_shortfall(requested: int, got: int, min_frequency: int = 2) -> str:
    """A one-line notice when training produced fewer ids than requested ("" when it reached the size)."""
    if got >= requested:
        return ""
    return (f"--vocab-size {requested} cannot be reached on this corpus: BPE merges stopped at {got} ids (no pair "
            f"of tokens left that occurs {min_frequency}+ times); the tokenizer has {got} ids. Use more text, or "
            f"keep model.vocab_size >= {got} (larger is fine: the extra embedding rows are never used)")


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tok.save(str(tmp), pretty=False)
    tmp.replace(p)
