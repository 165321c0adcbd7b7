"""Packed multimodal training rows: whole documents, media spans never cut, deterministic from the seed.

Megatron's GPTDataset cuts the token stream anywhere, which would split an image's placeholder run across two
rows (the encoder output could then not be placed). This packer works on documents instead:

1. **Pieces.** A document (one shard sample) of at most ``R = seq_len + 1`` tokens is one piece. A longer one is
   cut into pieces of at most ``R`` tokens, each cut at a text position: a cut that would fall inside a media
   span (``<|media_start|>``, the placeholders and the token after them, ``<|media_end|>`` when the tokenizer
   has it) moves back to the span's start. So every placeholder of a row is among its ``T`` input positions,
   and a micro-batch's placeholder count equals ``batch.media.num_tokens()``. A span longer than ``R`` is a
   start-up error (:mod:`k3train.data.multimodal.validate`).
2. **Order.** Epoch ``e`` takes the split's documents in the order ``numpy.random.default_rng([seed, e])
   .permutation``, each document's pieces in order.
3. **Rows.** Pieces are packed greedily into rows of ``R`` tokens; a piece that does not fit closes the row,
   which is padded with ``pad`` (``Batch.from_samples`` masks padding). A piece that is not the end of its
   document (no EOS) also closes its row, so no other document's tokens ever follow it inside a row (``doc_ids``
   count EOS tokens).
4. Row ``i`` of the dataset is row ``i`` of the concatenated epochs; epochs are added until ``num_samples``
   rows exist (train), or exactly one epoch is built (valid / test, read cyclically by the loader).

Everything depends only on the data, ``train.seed``, ``train.seq_len`` and ``data.split`` -- never on the
parallel layout -- so the global batch is the same for any pp/dp/cp. Documents go to the train/valid/test
splits by Megatron's ranges (:func:`k3train.data.dataset.split_document_ranges`).

Targets: positions whose label is a media placeholder get ``loss_mask = 0`` (and ``mtp_loss_mask = 0`` where
the t+2 target is one): the model never predicts the encoder's slots.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from k3train.config import SPLIT_NAMES
from k3train.data.batch import Batch
from k3train.data.corpus import DataError
from k3train.data.dataset import bin_path, rows_over_epochs, split_document_ranges
from k3train.data.multimodal.media_store import DOC, MediaStore
from k3train.data.multimodal.validate import MultimodalInfo, validate_multimodal_dataset, vision_geometry


def cut_document(length: int, spans: list[tuple[int, int]], row: int) -> list[tuple[int, int]]:
    """Pieces ``[(begin, end)]`` of a ``length``-token document with media ``spans`` (sorted ``[start, end)``),
    each at most ``row`` tokens and never inside a span."""
    pieces, pos, k = [], 0, 0
    while length - pos > row:
        cut = pos + row
        while k < len(spans) and spans[k][1] <= pos:
            k += 1
        j = k
        while j < len(spans) and spans[j][0] < cut:
            if spans[j][1] > cut:  # the cut falls inside span j: move it to the span's start
                cut = spans[j][0]
                break
            j += 1
        if cut <= pos:
            raise DataError(f"a media span of {spans[j][1] - spans[j][0]} tokens does not fit a row of {row}")
        pieces.append((pos, cut))
        pos = cut
    pieces.append((pos, length))
    return pieces


class MultimodalDataset:
    """The rows of one split of a prepared multimodal dataset (see the module docstring).

    ``len(ds)`` rows; :meth:`row` gives the ``seq_len + 1`` tokens and media ids of a row; :meth:`batch` a
    :class:`Batch` with ``media`` for a list of rows."""

    def __init__(self, prefix: str, tok: Any, seq_len: int, seed: int, split: str, which: str,
                 num_samples: int | None, max_media_pixels: int, patch_size: int = 14, merge: int = 2) -> None:
        self.mm: MultimodalInfo = validate_multimodal_dataset(prefix, tok, max_media_pixels, patch_size, merge,
                                                              seq_len)
        self.tok, self.row_len, self.seed = tok, seq_len + 1, seed
        info = self.mm.info
        rng = dict(zip(SPLIT_NAMES, split_document_ranges(info.num_sequences, split)))[which]
        if rng is None or rng[1] <= rng[0]:
            raise DataError(f"data.split={split!r} gives the {which} split of {prefix} no documents")
        self.docs = np.arange(rng[0], rng[1], dtype=np.int64)
        self.tokens = np.memmap(bin_path(prefix), dtype=info.dtype, mode="r")
        self.doc_start = np.concatenate([[0], np.cumsum(info.sequence_lengths.astype(np.int64))])
        media_doc = self.mm.media[:, DOC]
        self.media_lo = np.searchsorted(media_doc, np.arange(info.num_sequences), side="left")
        self.media_hi = np.searchsorted(media_doc, np.arange(info.num_sequences), side="right")
        self.store = MediaStore(prefix, patch_size)
        self._pieces = {int(d): self._cut(int(d)) for d in self.docs}
        # rows: list of [(doc, begin, end), ...]
        self.rows, self.num_epochs = rows_over_epochs(self._epoch_rows, num_samples)

    def _cut(self, doc: int) -> list[tuple[int, int]]:
        lo, hi = int(self.media_lo[doc]), int(self.media_hi[doc])
        spans = list(zip(self.mm.span_start[lo:hi].tolist(), self.mm.span_end[lo:hi].tolist()))
        return cut_document(int(self.mm.info.sequence_lengths[doc]), spans, self.row_len)

    def _epoch_rows(self, epoch: int) -> list[list[tuple[int, int, int]]]:
        order = self.docs[np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))]
        rows, cur, used = [], [], 0
        for d in order.tolist():
            pieces = self._pieces[d]
            for k, (b, e) in enumerate(pieces):
                if cur and used + (e - b) > self.row_len:
                    rows.append(cur)
                    cur, used = [], 0
                cur.append((d, b, e))
                used += e - b
                if k < len(pieces) - 1:  # a document's head piece: nothing of another document after it
                    rows.append(cur)
                    cur, used = [], 0
        if cur:
            rows.append(cur)
        return rows

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> tuple[np.ndarray, list[int]]:
        """``(tokens [seq_len + 1] int64, media ids in placeholder order)`` of row ``i``."""
        out = np.full(self.row_len, self.tok.pad_id, dtype=np.int64)
        media: list[int] = []
        pos = 0
        for d, b, e in self.rows[int(i)]:
            s = int(self.doc_start[d])
            out[pos:pos + e - b] = self.tokens[s + b:s + e]
            pos += e - b
            lo, hi = int(self.media_lo[d]), int(self.media_hi[d])
            starts = self.mm.span_start[lo:hi]
            media.extend((lo + np.flatnonzero((starts >= b) & (starts < e))).tolist())
        return out, media

    def batch(self, indices: np.ndarray) -> Batch:
        """The rows ``indices`` as a :class:`Batch` with their media (``MediaInputs.empty()`` when none)."""
        rows = [self.row(int(i)) for i in indices]
        batch = Batch.from_samples(torch.from_numpy(np.stack([r[0] for r in rows])), self.tok.eos_id,
                                   pad_id=self.tok.pad_id)
        ph = self.tok.media_id
        batch.loss_mask.masked_fill_(batch.labels == ph, 0.0)
        batch.mtp_loss_mask.masked_fill_(batch.mtp_labels == ph, 0.0)
        ids = [m for r in rows for m in r[1]]
        batch.media = self.store.inputs(ids)
        batch.media_rows = torch.tensor([k for k, r in enumerate(rows) for _ in r[1]], dtype=torch.long)
        batch.media_token_id = ph
        return batch


def build_multimodal_dataset(cfg: Any, tok: Any, split: str, num_samples: int | None) -> MultimodalDataset:
    """The loader's dataset for ``data.format: multimodal`` (not collective: every rank builds the same rows)."""
    patch, merge = vision_geometry(cfg)
    return MultimodalDataset(str(cfg.data.path), tok, int(cfg.train.seq_len), int(cfg.train.seed),
                             cfg.data.split, split, num_samples, int(cfg.data.max_media_pixels), patch, merge)
