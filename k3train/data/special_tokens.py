"""The names of a tokenizer's special tokens (``data.*_token``) and the file hash that ties data to a tokenizer.

Shared by both tokenizer kinds (:mod:`k3train.data.tokenizer` for ``tokenizer.json``,
:mod:`k3train.data.tiktoken_tokenizer` for a ``tiktoken.model`` ranks file)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)


@dataclass(frozen=True)
class SpecialTokens:
    """The literal names of the special tokens in a tokenizer (``data.*_token`` in the config); ``media``
    (a vision placeholder) is optional: "" = the tokenizer has none."""
    bos: str = BOS
    eos: str = EOS
    pad: str = PAD
    media: str = ""

    @classmethod
    def from_config(cls, data_cfg: Any) -> "SpecialTokens":
        """From a config's ``data`` section (defaults for an object without the fields)."""
        d = cls()
        return cls(*(getattr(data_cfg, f"{k}_token", getattr(d, k)) for k in ("bos", "eos", "pad")),
                   getattr(data_cfg, "media_placeholder_token", d.media))

    def named(self) -> list[tuple[str, str]]:
        """``[(config key, token name)]`` of the tokens that must exist."""
        out = [("data.bos_token", self.bos), ("data.eos_token", self.eos), ("data.pad_token", self.pad)]
        return out + ([("data.media_placeholder_token", self.media)] if self.media else [])


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
