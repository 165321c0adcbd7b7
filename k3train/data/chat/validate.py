"""Checks of a prepared chat dataset (tokens + loss mask), before a run starts (one line naming the file)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3train.data.chat.prepare import mask_prefix
from k3train.data.corpus import DataError
from k3train.data.dataset import (IndexInfo, bin_path, check_metadata, meta_path, split_document_ranges,
                                  validate_indexed_dataset)
from k3train.config import SPLIT_NAMES


@dataclass(frozen=True)
class ChatInfo:
    prefix: str
    tokens: IndexInfo
    mask_prefix: str


def validate_chat_dataset(prefix: str | Path, tok: Any) -> ChatInfo:
    """Tokens (ids in the tokenizer's range, made with it) and the mask beside them (same lengths, 0/1)."""
    tokens = validate_indexed_dataset(prefix, tok.vocab_size)
    check_metadata(prefix, tok)
    mp = meta_path(prefix)
    meta = json.loads(mp.read_text()) if mp.is_file() else {}
    if not isinstance(meta.get("chat"), dict):
        raise DataError(f"data.format=chat: {mp} names no chat loss mask: {prefix} was not made by "
                        "`k3train prepare-data --chat`")
    mprefix = mask_prefix(prefix)
    mask = validate_indexed_dataset(mprefix)
    if mask.dtype is not np.uint8 or not np.array_equal(mask.sequence_lengths, tokens.sequence_lengths):
        raise DataError(f"{mprefix}.idx: the loss mask does not match {prefix}.idx (uint8, one value per token of "
                        "each conversation): re-run `k3train prepare-data --chat`")
    values = np.memmap(bin_path(mprefix), dtype=np.uint8, mode="r")
    if values.size and int(values.max()) > 1:
        raise DataError(f"{mprefix}.bin: loss mask values must be 0 or 1")
    return ChatInfo(str(prefix), tokens, mprefix)


def check_chat_data(cfg: Any, tok: Any, splits: list[str]) -> None:
    """Preflight for ``data.format: chat``: the files, and every split read keeps a conversation."""
    try:
        info = validate_chat_dataset(cfg.data.path, tok)
    except DataError as e:
        raise DataError(f"data.path: {e}") from None
    row = int(cfg.train.seq_len) + 1
    ranges = dict(zip(SPLIT_NAMES, split_document_ranges(info.tokens.num_sequences, cfg.data.split)))
    for name in splits:
        rng = ranges[name]
        if rng is None or rng[1] <= rng[0]:
            raise DataError(f"data.split={cfg.data.split!r} gives the {name} split of {cfg.data.path} no "
                            "conversations")
        lengths = info.tokens.sequence_lengths[rng[0]:rng[1]]
        if cfg.data.chat_overlong == "drop" and not (lengths <= row).any():
            raise DataError(f"data.chat_overlong=drop: every conversation of the {name} split of {cfg.data.path} is "
                            f"longer than seq_len+1={row} tokens; raise train.seq_len or use "
                            "data.chat_overlong=truncate")
