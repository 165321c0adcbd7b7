"""A tiktoken tokenizer read from a checkpoint's files: ``tiktoken.model`` + ``tokenizer_config.json``.

Kimi Linear, K2 and K3 checkpoints ship no ``tokenizer.json``: their tokenizer is tiktoken BPE over

* a ranks file ``tiktoken.model`` (one ``<base64 token bytes> <rank>`` per line; the ranks are the ids),
* a pre-tokenizer pattern that lives in the checkpoint's tokenizer CODE (``tokenization_kimi.py``), not in its
  files: k3train carries it as a named pattern (:data:`PATTERNS`), chosen by the tokenizer class that
  ``tokenizer_config.json`` names (:data:`TOKENIZER_CLASSES`); a class it does not know is refused (one line),
  never run,
* special tokens at the ids after the ranks: those ``tokenizer_config.json`` lists in ``added_tokens_decoder``, the
  other reserved ids named ``<|reserved_token_{id}|>`` (as the checkpoint's code names them).

Encoding recognises special-token text (``allowed_special="all"``, as the checkpoint's own ``encode`` does: a
rendered chat template's ``<|im_end|>`` is one token). Text is cut before encoding where tiktoken cannot take it
whole: every 400,000 characters, and inside any run of more than 25,000 whitespace or non-whitespace characters
(every 25,000 characters of the run), the limits of the checkpoint's code. Nothing is downloaded: the ranks are read
from the file here, and :class:`tiktoken.Encoding` is built from them.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import tiktoken

from k3train.data.corpus import DataError
from k3train.data.special_tokens import SpecialTokens
from k3train.data.tokenizer_config import TokenizerConfig, read_tokenizer_config

# The pre-tokenizer pattern of Kimi's tiktoken tokenizers (tokenization_kimi.py of Kimi Linear, K2 and K3): runs of
# Han characters alone, words with their leading punctuation and English contractions, at most 3 digits, symbol runs
# with their newlines, newline runs, then whitespace.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# name -> (pattern, number of reserved special-token ids after the ranks)
PATTERNS: dict[str, tuple[str, int]] = {"kimi": (KIMI_PATTERN, 256)}
# the tokenizer class tokenizer_config.json names (auto_map.AutoTokenizer, else tokenizer_class) -> pattern name
TOKENIZER_CLASSES = {"tokenization_kimi.TikTokenTokenizer": "kimi", "TikTokenTokenizer": "kimi"}
RANKS_NAME = "tiktoken.model"
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))


def is_tiktoken_file(path: str | Path) -> bool:
    """A ``data.tokenizer`` that names a tiktoken ranks file (``*.model``, e.g. ``tiktoken.model``)."""
    return Path(path).name.endswith(".model") or Path(path).name == RANKS_NAME


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """The ranks of a tiktoken BPE file (``<base64> <rank>`` per line). :class:`DataError` naming the line."""
    p = Path(path)
    ranks: dict[bytes, int] = {}
    try:
        lines = p.read_bytes().splitlines()
    except OSError as e:
        raise DataError(f"cannot read tokenizer {p}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except ValueError:
            raise DataError(f"{p}:{n}: not a tiktoken ranks line ('<base64 token> <rank>')") from None
    if not ranks:
        raise DataError(f"{p}: the tiktoken ranks file holds no tokens")
    return ranks


def pattern_for(tc: TokenizerConfig, ranks_file: Path) -> str:
    """The named pattern the checkpoint's tokenizer class uses; a class we do not know is one line."""
    cls = tc.auto_tokenizer or tc.tokenizer_class
    for name in (tc.auto_tokenizer, tc.tokenizer_class):
        if name in TOKENIZER_CLASSES:
            return TOKENIZER_CLASSES[name]
    where = tc.path or f"{ranks_file.parent / 'tokenizer_config.json'} (missing)"
    raise DataError(f"{where}: tokenizer class {cls or '(none named)'!r} is not a tiktoken tokenizer k3train knows "
                    f"(known: {', '.join(sorted(TOKENIZER_CLASSES))}); its pre-tokenizer pattern lives in that "
                    "class's code, which k3train does not run")


def split_for_tiktoken(text: str) -> Iterator[str]:
    """``text`` in pieces tiktoken encodes whole (module docstring: the 400,000 / 25,000 character limits)."""
    for i in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
        chunk = text[i:i + MAX_ENCODE_CHARS]
        pos = 0
        for m in _LONG_RUN.finditer(chunk):
            for cut in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS):
                yield chunk[pos:cut]
                pos = cut
        yield chunk[pos:]


def read_tiktoken_files(p: Path) -> tuple[TokenizerConfig, str, dict[bytes, int], dict[str, int]]:
    """``(tokenizer config, pattern name, ranks, special tokens)`` of ranks file ``p`` and the config beside it."""
    config = read_tokenizer_config(p)
    pattern_name = pattern_for(config, p)
    ranks = read_ranks(p)
    base = max(ranks.values()) + 1
    clash = sorted(i for i in config.added_tokens if i < base)
    if clash:
        raise DataError(f"{config.path}: added token id {clash[0]} is a BPE rank of {p} (special tokens start at "
                        f"{base})")
    top = max([base + PATTERNS[pattern_name][1] - 1, *config.added_tokens])
    specials = {config.added_tokens.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, top + 1)}
    return config, pattern_name, ranks, specials


def _digest(p: Path, pattern_name: str, specials: dict[str, int]) -> str:
    h = hashlib.sha256(p.read_bytes())
    h.update(json.dumps([pattern_name, sorted(specials.items(), key=lambda kv: kv[1])]).encode())
    return h.hexdigest()


def tiktoken_sha256(path: str | Path) -> str:
    """What :attr:`TiktokenTokenizer.sha256` is for ranks file ``path`` (without resolving any token names)."""
    _, name, _, specials = read_tiktoken_files(Path(path))
    return _digest(Path(path), name, specials)


class TiktokenTokenizer:
    """The :class:`k3train.data.tokenizer.TextTokenizer` interface over a tiktoken encoding (module docstring).

    ``path`` is the ranks file, ``sha256`` covers the ranks file, the pattern name and the special tokens."""

    kind = "tiktoken"

    def __init__(self, path: str | Path, special: SpecialTokens | None = None) -> None:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"tokenizer file not found: {p}")
        self.config, self.pattern_name, ranks, specials = read_tiktoken_files(p)
        self._enc = tiktoken.Encoding(name=p.name, pat_str=PATTERNS[self.pattern_name][0], mergeable_ranks=ranks,
                                      special_tokens=specials)
        self._specials, self._ranks = specials, ranks
        self.path, self.special = str(p), special or SpecialTokens()
        self.sha256 = _digest(p, self.pattern_name, specials)
        ids = {}
        for key, name in self.special.named():
            if name not in specials:
                raise DataError(f"{key}: tokenizer {p} has no special token {name!r} (its special tokens come from "
                                f"{self.config.path or 'tokenizer_config.json'}: added_tokens_decoder); set {key} to "
                                f"one it has (e.g. {self.config.named_tokens.get(key.split('.')[1], '[EOS]')!r})")
            ids[key] = specials[name]
        self.bos_id, self.eos_id, self.pad_id = ids["data.bos_token"], ids["data.eos_token"], ids["data.pad_token"]
        self.media_id: int | None = ids.get("data.media_placeholder_token")
        self.vocab_size: int = self._enc.n_vocab
        self.special_ids = frozenset(ids.values())
        self.all_special_ids = frozenset(specials.values())
        self.chat_template = self.config.chat_template
        self.template_tokens = dict(self.config.named_tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token text becomes the special token; no special tokens added)."""
        out: list[int] = []
        for piece in split_for_tiktoken(text):
            out.extend(self._enc.encode(piece, allowed_special="all"))
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if all(len(t) <= MAX_RUN_CHARS for t in texts):
            return self._enc.encode_batch(texts, allowed_special="all")
        return [self.encode(t) for t in texts]

    def encode_offsets(self, text: str) -> tuple[list[int], np.ndarray]:
        """``(ids, spans)``: spans ``[n, 2]`` of each token's characters in ``text`` (a token that holds part of a
        character covers that character)."""
        ids = self.encode(text)
        nbytes = np.array([len(self._enc.decode_single_token_bytes(i)) for i in ids], dtype=np.int64)
        ends = np.cumsum(nbytes)
        starts = ends - nbytes
        char_bytes = np.array([len(c.encode("utf-8")) for c in text], dtype=np.int64)
        char_start = np.concatenate([[0], np.cumsum(char_bytes)])  # byte offset of char i (and the end)
        first = np.searchsorted(char_start, starts, side="right") - 1
        last = np.searchsorted(char_start, ends, side="left")
        return ids, np.stack([first, last], axis=1) if ids else np.zeros((0, 2), dtype=np.int64)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        return self._enc.decode(ids)

    def token_to_id(self, name: str) -> int | None:
        if name in self._specials:
            return self._specials[name]
        return self._ranks.get(name.encode("utf-8"))

    def __repr__(self) -> str:
        return (f"TiktokenTokenizer(path={self.path!r}, pattern={self.pattern_name!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id})")
