"""Start-up checks of a prepared multimodal dataset (run by :mod:`k3train.preflight` for ``data.format:
multimodal``, and by the loader): one :class:`DataError` naming the file and the media.

* the token dataset itself (:func:`k3train.data.dataset.validate_indexed_dataset`) and its tokenizer metadata;
* ``PREFIX.meta.json``'s ``multimodal`` entry: made with this patch geometry and this placeholder id;
* the media store (:func:`k3train.data.multimodal.media_store.load_media_index`): offsets against the data file;
* every media: frames >= 1, height and width multiples of ``patch_size * merge`` (what the encoder needs),
  ``height * width <= data.max_media_pixels``;
* the placeholders: media in (document, position) order, and for each one exactly ``merged_tokens(grid)``
  placeholder tokens at its recorded position with no placeholder right before or after it, and no
  placeholder token anywhere else (a count that does not match its media is caught here, not as a shape error
  inside the model);
* no media span (placeholders + delimiters) longer than a row of ``seq_len + 1`` tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3train.config import SPLIT_NAMES
from k3train.data.corpus import DataError
from k3train.data.dataset import (
    IndexInfo,
    bin_path,
    check_metadata,
    meta_path,
    split_document_ranges,
    validate_indexed_dataset,
)
from k3train.data.multimodal.media_store import DOC, FRAMES, HEIGHT, TOKEN, WIDTH, load_media_index, media_index_path
from k3train.model.media import merged_tokens


@dataclass
class MultimodalInfo:
    """A validated multimodal dataset: the token index, the media index and the per-media spans."""

    info: IndexInfo
    media: np.ndarray  # [n_media, 6] (media_store columns)
    num_tokens: np.ndarray  # [n_media] placeholder tokens of each media
    span_start: np.ndarray  # [n_media] token offset in its document of the span (delimiters included)
    span_end: np.ndarray  # [n_media] exclusive
    meta: dict[str, Any]


def vision_geometry(cfg: Any) -> tuple[int, int]:
    """``(patch_size, merge)`` of the run's vision encoder: ``vision.patch_size`` / ``vision.merge_size`` (K3's
    14 / 2 for an object without a vision section)."""
    v = getattr(cfg, "vision", None)
    return int(getattr(v, "patch_size", 14)), int(getattr(v, "merge_size", 2))


def _read_meta(prefix: str | Path) -> dict[str, Any]:
    mp = meta_path(prefix)
    try:
        meta = json.loads(mp.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{mp}: unreadable metadata ({str(e).splitlines()[0]})") from None
    mm = meta.get("multimodal") if isinstance(meta, dict) else None
    if not isinstance(mm, dict):
        raise DataError(f"{mp}: not a multimodal dataset (no 'multimodal' entry; make it with tools/prepare_data.py "
                        "--multimodal, or set data.format=text)")
    return mm


def validate_multimodal_dataset(prefix: str | Path, tok: Any, max_media_pixels: int, patch_size: int = 14,
                                merge: int = 2, seq_len: int | None = None) -> MultimodalInfo:
    """All checks of the module docstring; ``tok`` is the run's tokenizer (needs a media placeholder)."""
    info = validate_indexed_dataset(prefix, tok.vocab_size)
    check_metadata(prefix, tok)
    mm = _read_meta(prefix)
    mp, ip = meta_path(prefix), media_index_path(prefix)
    if tok.media_id is None:
        raise DataError("data.media_placeholder_token: a multimodal dataset needs the tokenizer's media placeholder")
    for key, ours in (("patch_size", patch_size), ("merge", merge), ("placeholder_id", tok.media_id)):
        if mm.get(key) != ours:
            raise DataError(f"{mp}: prepared with {key}={mm.get(key)!r} but the run uses {ours!r}: re-run "
                            "tools/prepare_data.py --multimodal")
    media = load_media_index(prefix)
    unit = patch_size * merge
    t, h, w = media[:, FRAMES], media[:, HEIGHT], media[:, WIDTH]
    bad = (h % unit != 0) | (w % unit != 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"{ip}: media {i} (document {int(media[i, DOC])}) is {int(w[i])}x{int(h[i])} px: height and "
                        f"width must be multiples of patch_size * merge = {unit} (re-run tools/prepare_data.py "
                        "--multimodal, which resizes)")
    big = h * w > max_media_pixels
    if big.any():
        i = int(np.argmax(big))
        raise DataError(f"data.max_media_pixels: {ip}: media {i} (document {int(media[i, DOC])}) is {int(w[i])}x"
                        f"{int(h[i])} = {int(h[i] * w[i])} px, larger than the limit of {max_media_pixels} px")
    n_tok = np.asarray([merged_tokens(int(a), int(b) // patch_size, int(c) // patch_size, merge)
                        for a, b, c in zip(t, h, w)], dtype=np.int64)
    n_seq = info.num_sequences
    if len(media) and ((media[:, DOC] < 0) | (media[:, DOC] >= n_seq)).any():
        i = int(np.argmax((media[:, DOC] < 0) | (media[:, DOC] >= n_seq)))
        raise DataError(f"{ip}: media {i} belongs to document {int(media[i, DOC])} of a dataset with {n_seq}")
    doc_start = np.concatenate([[0], np.cumsum(info.sequence_lengths.astype(np.int64))])
    start = doc_start[media[:, DOC]] + media[:, TOKEN]
    end = start + n_tok
    if len(media) and ((media[:, TOKEN] < 0) | (end > doc_start[media[:, DOC] + 1])).any():
        i = int(np.argmax((media[:, TOKEN] < 0) | (end > doc_start[media[:, DOC] + 1])))
        raise DataError(f"{ip}: media {i}'s {int(n_tok[i])} placeholders at token {int(media[i, TOKEN])} run past "
                        f"the end of document {int(media[i, DOC])}")
    if len(media) > 1 and (start[1:] < end[:-1]).any():
        i = int(np.argmax(start[1:] < end[:-1])) + 1
        raise DataError(f"{ip}: media {i} overlaps or precedes media {i - 1}: index not in document order")
    data = np.memmap(bin_path(prefix), dtype=info.dtype, mode="r")
    is_ph = np.asarray(data == tok.media_id)
    cum = np.concatenate([[0], np.cumsum(is_ph, dtype=np.int64)])
    found = cum[end] - cum[start]
    before = np.where(start > 0, is_ph[np.maximum(start - 1, 0)], False)
    after = np.where(end < is_ph.size, is_ph[np.minimum(end, is_ph.size - 1)], False)
    wrong = (found != n_tok) | before | after
    if wrong.any():
        i = int(np.argmax(wrong))
        run = int(found[i]) + int(before[i]) + int(after[i])
        raise DataError(f"{bin_path(prefix)}: media {i} (document {int(media[i, DOC])}, grid "
                        f"{int(t[i])}x{int(h[i]) // patch_size}x{int(w[i]) // patch_size}) needs exactly "
                        f"{int(n_tok[i])} placeholder tokens at token {int(media[i, TOKEN])}, found a run of "
                        f"{'at least ' if run > found[i] else ''}{run}: tokens and media store do not match")
    if int(cum[-1]) != int(n_tok.sum()):
        pos = np.flatnonzero(is_ph)
        owned = np.zeros(is_ph.size, dtype=bool)
        for s, e in zip(start, end):
            owned[s:e] = True
        stray = int(pos[~owned[pos]][0])
        doc = int(np.searchsorted(doc_start, stray, side="right") - 1)
        raise DataError(f"{bin_path(prefix)}: {int(cum[-1])} placeholder tokens but the media store accounts for "
                        f"{int(n_tok.sum())}: document {doc} has placeholders at token {stray - int(doc_start[doc])} "
                        "that belong to no media")
    del data
    # a span: the media's placeholders, its <|media_start|> if any, and the token right after the run (its
    # <|media_end|>, or the next text token / EOS, which every document has): keeping that token in the same row
    # puts every placeholder among the row's T input positions, never only at the last one (a label)
    span_start = media[:, TOKEN] - (1 if mm.get("media_start_id") is not None else 0)
    span_end = media[:, TOKEN] + n_tok + 1
    if seq_len is not None and len(media) and int((span_end - span_start).max()) > seq_len + 1:
        i = int(np.argmax(span_end - span_start))
        raise DataError(f"train.seq_len={seq_len}: media {i} (document {int(media[i, DOC])}, {int(w[i])}x{int(h[i])}"
                        f" px) takes {int(span_end[i] - span_start[i])} tokens, more than a row of seq_len+1="
                        f"{seq_len + 1}; media spans are never cut across rows: raise train.seq_len or lower "
                        "data.max_media_pixels and re-prepare")
    return MultimodalInfo(info, media, n_tok, span_start, span_end, mm)


def check_multimodal_data(cfg: Any, tok: Any, splits: list[str]) -> None:
    """Preflight for ``data.format: multimodal``: the dataset checks above with the run's limits, and every split
    the run reads holding at least one document. Messages name ``data.path`` (or the key at fault)."""
    patch, merge = vision_geometry(cfg)
    try:
        mm = validate_multimodal_dataset(cfg.data.path, tok, int(cfg.data.max_media_pixels), patch, merge,
                                         int(cfg.train.seq_len))
    except DataError as e:
        msg = str(e)
        raise DataError(msg if msg.startswith(("data.", "train.")) else f"data.path: {msg}") from None
    v = getattr(cfg, "vision", None)
    max_t = getattr(v, "pos_emb_time", None) if getattr(v, "enabled", False) else None
    if max_t is not None and len(mm.media) and int(mm.media[:, FRAMES].max()) > max_t:
        i = int(np.argmax(mm.media[:, FRAMES]))
        raise DataError(f"vision.pos_emb_time={max_t}: {media_index_path(cfg.data.path)}: media {i} (document "
                        f"{int(mm.media[i, DOC])}) is a clip of {int(mm.media[i, FRAMES])} frames, more than the "
                        "temporal table holds")
    ranges = dict(zip(SPLIT_NAMES, split_document_ranges(mm.info.num_sequences, cfg.data.split)))
    for name in splits:
        rng = ranges[name]
        if rng is None or rng[1] <= rng[0]:
            raise DataError(f"data.split={cfg.data.split!r}: the {name} split of {cfg.data.path} gets no documents "
                            f"(of {mm.info.num_sequences}); use a larger dataset or give the split weight 0")
