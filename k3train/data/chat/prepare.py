"""``k3train prepare-data --chat``: JSONL conversations -> tokens + assistant-only loss mask, in the indexed format.

Each conversation is rendered with the chat template (:mod:`k3train.data.chat.template`), tokenized whole with the
checkpoint's tokenizer (as transformers tokenizes a rendered chat), and stored as ONE document of the Megatron
indexed dataset ``PREFIX.bin/.idx`` with the tokenizer's EOS appended (the EOS separates packed conversations).
Beside it, ``PREFIX.mask.bin/.idx`` is an indexed dataset of the same lengths (uint8): 1 on every token that
overlaps the assistant's text -- its answers and each answer's end-of-turn token, with transformers' rule for a
token that straddles a span's edge -- and 0 on everything else (system and user turns, role headers, tool
results, the appended EOS). ``PREFIX.meta.json`` records the tokenizer (its hash), the template (its hash and
where it came from), the mask's prefix and the counts.

Nothing is written when any conversation fails (one line naming file and line): the files are written under
temporary names and renamed at the end.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3train.data.chat.messages import Conversation, read_conversations
from k3train.data.chat.template import ChatTemplate, TemplateFailed, assistant_spans
from k3train.data.corpus import DataError
from k3train.data.dataset import IndexInfo, bin_path, idx_path, mcore_quiet, write_indexed_dataset

MASK_SUFFIX = ".mask"


def mask_prefix(prefix: str | Path) -> str:
    """The prefix of the loss-mask dataset beside tokens ``prefix``."""
    return str(prefix) + MASK_SUFFIX


@dataclass
class ChatStats:
    conversations: int = 0
    tokens: int = 0
    assistant_tokens: int = 0


def token_mask(spans: np.ndarray, char_spans: list[tuple[int, int]]) -> np.ndarray:
    """1 where token ``[start, end)`` (``spans [n, 2]``) overlaps one of ``char_spans`` (sorted, disjoint)."""
    mask = np.zeros(len(spans), dtype=np.uint8)
    if not char_spans or len(spans) == 0:
        return mask
    lo = np.array([s for s, _ in char_spans])
    hi = np.array([e for _, e in char_spans])
    # the last span starting before each token's end; the token overlaps it when it also ends after the token start
    k = np.searchsorted(lo, spans[:, 1], side="left") - 1
    ok = k >= 0
    mask[ok] = (hi[k[ok]] > spans[ok, 0]).astype(np.uint8)
    return mask


def encode_conversation(conv: Conversation, tpl: ChatTemplate, tok: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(token ids, mask)`` of one conversation (no EOS). :class:`DataError` naming its ``file:line``."""
    try:
        text, spans = assistant_spans(tpl, conv.messages, conv.tools)
    except TemplateFailed as e:
        raise DataError(f"{conv.source}: {e}") from None
    ids, offsets = tok.encode_offsets(text)
    mask = token_mask(offsets, spans)
    if not mask.any():
        raise DataError(f"{conv.source}: the rendered conversation has no assistant tokens (the template renders "
                        "no text for its assistant turns)")
    return np.asarray(ids, dtype=np.int64), mask


def chat_template_of(tok: Any, template_file: str | Path | None = None) -> tuple[ChatTemplate, str]:
    """``(template, where it came from)``: ``template_file``, else the tokenizer's (tokenizer_config.json's
    ``chat_template`` or ``chat_template.jinja``). One :class:`DataError` line when there is none or it does not
    compile."""
    if template_file:
        p = Path(template_file)
        if not p.is_file():
            raise DataError(f"--chat-template: file not found: {p}")
        source, where = p.read_text(encoding="utf-8"), str(p)
    elif tok.chat_template:
        source, where = tok.chat_template, tok.config.chat_template_source if hasattr(tok, "config") else tok.path
    else:
        raise DataError(f"tokenizer {tok.path} has no chat template (no chat_template in the tokenizer_config.json "
                        "beside it, no chat_template.jinja): give one with --chat-template FILE")
    try:
        return ChatTemplate(source, tok.template_tokens), where
    except TemplateFailed as e:
        raise DataError(f"{where}: {e}") from None


def _write_masks(prefix: str, masks: Iterator[np.ndarray]) -> None:
    with mcore_quiet():  # lazy: megatron's dataset modules take seconds to import
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(bin_path(prefix)), dtype=np.uint8)
    for m in masks:
        builder.add_document(m, [m.size])
    builder.finalize(str(idx_path(prefix)))


def prepare_chat(inputs: Sequence[str | Path], tok: Any, output_prefix: str | Path,
                 template_file: str | Path | None = None) -> tuple[IndexInfo, ChatStats]:
    """Tokenize the conversations of ``inputs`` (``.jsonl[.gz]``) into ``output_prefix`` (module docstring)."""
    if not inputs:
        raise DataError("no input files given")
    for p in inputs:
        if not Path(p).is_file():
            raise DataError(f"input file not found: {p}")
    tpl, where = chat_template_of(tok, template_file)
    names = sorted(n for n in _special_names(tok))
    for p in inputs:  # every line's JSON and messages first (cheap): bad input fails before any work starts
        for _ in read_conversations(p, names):
            pass
    stats = ChatStats()
    masks: list[np.ndarray] = []

    def docs() -> Iterator[np.ndarray]:
        for p in inputs:
            for conv in read_conversations(p, names):
                ids, mask = encode_conversation(conv, tpl, tok)
                masks.append(np.concatenate([mask, np.zeros(1, dtype=np.uint8)]))  # the appended EOS: 0
                stats.conversations += 1
                stats.tokens += ids.size + 1
                stats.assistant_tokens += int(mask.sum())
                yield ids

    out = Path(output_prefix)
    tmp_mask = out.with_name(out.name + f".tmpmask{os.getpid()}")
    meta = {"tokenizer": str(tok.path), "tokenizer_sha256": tok.sha256, "inputs": [str(p) for p in inputs],
            "chat": {"mask": Path(mask_prefix(out)).name, "template": where,
                     "template_sha256": hashlib.sha256(tpl.source.encode()).hexdigest(),
                     "generation_blocks": tpl.has_generation_blocks}}
    try:
        info = write_indexed_dataset(out, _then(docs(), lambda: _write_masks(str(tmp_mask), iter(masks))),
                                     tok.eos_id, tok.vocab_size, meta, extra_files=(str(tmp_mask), mask_prefix(out)))
    finally:
        for fn in (bin_path, idx_path):
            with contextlib.suppress(FileNotFoundError):
                fn(tmp_mask).unlink()
    return info, stats


def _then(it: Iterator[np.ndarray], finish: Any) -> Iterator[np.ndarray]:
    """``it``, then ``finish()`` once it is exhausted (still inside the writer, before anything is renamed)."""
    yield from it
    finish()


def _special_names(tok: Any) -> list[str]:
    """The text of every special token of ``tok`` (a message holding one is refused)."""
    return [tok.decode([i]) for i in sorted(tok.all_special_ids)]
