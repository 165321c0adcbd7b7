"""What a Hugging Face checkpoint's ``tokenizer_config.json`` (and ``chat_template.jinja``) says about its tokenizer.

Read beside the tokenizer file a run names (``data.tokenizer``: a ``tokenizer.json`` or a ``tiktoken.model``):

* ``tokenizer_class`` (and ``auto_map.AutoTokenizer``): which tokenizer code the checkpoint ships; for a tiktoken
  ranks file it chooses the pre-tokenizer pattern (:mod:`k3train.data.tiktoken_tokenizer`);
* ``added_tokens_decoder`` (``{"id": {"content": ..., "special": ...}}``): the special tokens and their ids;
* ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` (a string or ``{"content": ...}``): the names the chat
  template sees under those variables, and the names ``k3train import-hf`` writes into ``data.*_token``;
* the chat template: ``chat_template.jinja`` beside it, else ``chat_template`` (a string, or a list of
  ``{"name", "template"}`` of which ``default`` is taken).

Nothing here runs the checkpoint's code. A malformed file is one :class:`DataError` line naming it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3train.data.corpus import DataError

CONFIG_NAME = "tokenizer_config.json"
TEMPLATE_NAME = "chat_template.jinja"
NAMED_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_name(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


@dataclass
class TokenizerConfig:
    """The parts of ``tokenizer_config.json`` k3train reads (all empty when the file is absent)."""

    path: str = ""
    tokenizer_class: str = ""
    auto_tokenizer: str = ""  # auto_map.AutoTokenizer[0], e.g. "tokenization_kimi.TikTokenTokenizer"
    added_tokens: dict[int, str] = field(default_factory=dict)  # id -> content
    named_tokens: dict[str, str] = field(default_factory=dict)  # "bos_token" -> "[BOS]", ...
    chat_template: str | None = None
    chat_template_source: str = ""


def _chat_template(cj: dict[str, Any], where: Path) -> str | None:
    t = cj.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise DataError(f"{where}: chat_template is a list without a 'default' template")
    raise DataError(f"{where}: chat_template must be a string or a list of named templates")


def read_tokenizer_config(tokenizer_file: str | Path) -> TokenizerConfig:
    """The ``tokenizer_config.json`` (and ``chat_template.jinja``) in the directory of ``tokenizer_file``."""
    d = Path(tokenizer_file).parent
    p = d / CONFIG_NAME
    out = TokenizerConfig()
    if p.is_file():
        try:
            cj = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"{p}: not valid JSON ({str(e).splitlines()[0]})") from None
        if not isinstance(cj, dict):
            raise DataError(f"{p}: must hold a JSON object")
        out.path = str(p)
        out.tokenizer_class = str(cj.get("tokenizer_class") or "")
        auto = (cj.get("auto_map") or {}).get("AutoTokenizer") if isinstance(cj.get("auto_map"), dict) else None
        if isinstance(auto, list) and auto and isinstance(auto[0], str):
            out.auto_tokenizer = auto[0]
        elif isinstance(auto, str):
            out.auto_tokenizer = auto
        added = cj.get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise DataError(f"{p}: added_tokens_decoder must be an object of id -> token")
        for k, v in added.items():
            name = _token_name(v)
            if not str(k).isdigit() or name is None:
                raise DataError(f"{p}: added_tokens_decoder[{k!r}] is not an id with a 'content' string")
            out.added_tokens[int(k)] = name
        for key in NAMED_TOKEN_KEYS:
            name = _token_name(cj.get(key))
            if name is not None:
                out.named_tokens[key] = name
        out.chat_template = _chat_template(cj, p)
        if out.chat_template is not None:
            out.chat_template_source = f"{p} (chat_template)"
    jinja = d / TEMPLATE_NAME
    if jinja.is_file():
        out.chat_template, out.chat_template_source = jinja.read_text(encoding="utf-8"), str(jinja)
    return out
