"""Packed chat training rows: whole conversations, the loss on the assistant's tokens only.

A prepared chat dataset (:mod:`k3train.data.chat.prepare`) holds one document per conversation (its tokens, then
EOS) and, beside it, the loss mask (1 on the assistant's tokens). Rows of ``R = seq_len + 1`` tokens:

1. **Long conversations.** One of more than ``R`` tokens is dropped (``data.chat_overlong: drop``) or cut to its
   first ``R`` tokens (``truncate``; it then fills a row alone). The counts are logged for each split built.
2. **Order.** Epoch ``e`` takes the split's conversations in the order ``numpy.random.default_rng([seed, e])
   .permutation`` (the same rule as the multimodal packer).
3. **Rows.** Conversations are packed greedily; one that does not fit closes the row, which is padded with
   ``pad`` (``Batch.from_samples`` masks padding). Each conversation is a document of its row (``doc_ids`` count
   EOS tokens: its own KDA state and MLA mask).
4. Train: epochs are added until ``num_samples`` rows exist; valid / test: exactly one epoch (read cyclically).

Targets (:meth:`ChatDataset.batch`): ``loss_mask[t]`` is ``Batch.from_samples``' mask times the stored mask of the
token it predicts (``x[t+1]``), ``mtp_loss_mask[t]`` likewise with ``x[t+2]``: both losses are over the assistant's
tokens only. The trainer's loss is already the mean over the loss-masked tokens of the whole global batch
(``LossNorm``), so it is the mean over the global batch's assistant tokens in every layout and micro-batch split; a
micro-batch (or a rank) whose rows hold no assistant token contributes zero and joins every collective as usual.

Everything depends only on the data, ``train.seed``, ``train.seq_len``, ``data.split`` and
``data.chat_overlong`` -- never on the parallel layout.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from k3train.config import SPLIT_NAMES
from k3train.data.batch import Batch
from k3train.data.chat.validate import ChatInfo, validate_chat_dataset
from k3train.data.corpus import DataError
from k3train.data.dataset import bin_path, rows_over_epochs, split_document_ranges

logger = logging.getLogger(__name__)


def split_conversations(info: ChatInfo, split: str, which: str) -> np.ndarray:
    """The conversation (document) indices of split ``which`` (Megatron's ranges, as the text datasets)."""
    rng = dict(zip(SPLIT_NAMES, split_document_ranges(info.tokens.num_sequences, split)))[which]
    if rng is None or rng[1] <= rng[0]:
        raise DataError(f"data.split={split!r} gives the {which} split of {info.prefix} no conversations")
    return np.arange(rng[0], rng[1], dtype=np.int64)


def fitted_lengths(lengths: np.ndarray, row: int, overlong: str) -> tuple[np.ndarray, int]:
    """``(tokens each conversation keeps (0 = dropped), number dropped or truncated)``."""
    long = lengths > row
    kept = np.where(long, 0 if overlong == "drop" else row, lengths)
    return kept.astype(np.int64), int(long.sum())


class ChatDataset:
    """The rows of one split of a prepared chat dataset (module docstring). ``len(ds)`` rows; :meth:`row` gives a
    row's tokens and mask, :meth:`batch` a :class:`Batch` of rows with the assistant-only masks."""

    def __init__(self, prefix: str, tok: Any, seq_len: int, seed: int, split: str, which: str,
                 num_samples: int | None, overlong: str = "drop") -> None:
        self.info = validate_chat_dataset(prefix, tok)
        self.tok, self.row_len, self.seed = tok, seq_len + 1, seed
        docs = split_conversations(self.info, split, which)
        lengths = self.info.tokens.sequence_lengths[docs].astype(np.int64)
        kept, n_long = fitted_lengths(lengths, self.row_len, overlong)
        self.docs, self.kept = docs[kept > 0], kept[kept > 0]
        verb = "dropped" if overlong == "drop" else "truncated"
        self.num_overlong = n_long
        msg = (f"chat data {prefix} ({which} split): {len(docs)} conversations, {n_long} longer than "
               f"seq_len+1={self.row_len} tokens {verb} (data.chat_overlong={overlong})")
        (logger.warning if n_long else logger.info)(msg)
        if len(self.docs) == 0:
            raise DataError(f"data.chat_overlong=drop: every conversation of the {which} split of {prefix} is longer "
                            f"than seq_len+1={self.row_len} tokens; raise train.seq_len or use "
                            "data.chat_overlong=truncate")
        self.tokens = np.memmap(bin_path(prefix), dtype=self.info.tokens.dtype, mode="r")
        self.mask = np.memmap(bin_path(self.info.mask_prefix), dtype=np.uint8, mode="r")
        self.doc_start = np.concatenate([[0], np.cumsum(self.info.tokens.sequence_lengths.astype(np.int64))])
        self.rows, self.num_epochs = rows_over_epochs(self._epoch_rows, num_samples)  # [(doc, kept tokens), ...]

    def _epoch_rows(self, epoch: int) -> list[list[tuple[int, int]]]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
        rows, cur, used = [], [], 0
        for k in order.tolist():
            d, n = int(self.docs[k]), int(self.kept[k])
            if cur and used + n > self.row_len:
                rows.append(cur)
                cur, used = [], 0
            cur.append((d, n))
            used += n
        if cur:
            rows.append(cur)
        return rows

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [seq_len + 1] int64, assistant mask [seq_len + 1] uint8)`` of row ``i``."""
        out = np.full(self.row_len, self.tok.pad_id, dtype=np.int64)
        mask = np.zeros(self.row_len, dtype=np.uint8)
        pos = 0
        for d, n in self.rows[int(i)]:
            s = int(self.doc_start[d])
            out[pos:pos + n] = self.tokens[s:s + n]
            mask[pos:pos + n] = self.mask[s:s + n]
            pos += n
        return out, mask

    def batch(self, indices: np.ndarray) -> Batch:
        """The rows ``indices`` as a :class:`Batch` whose masks keep only the assistant's tokens as targets."""
        rows = [self.row(int(i)) for i in indices]
        batch = Batch.from_samples(torch.from_numpy(np.stack([r[0] for r in rows])), self.tok.eos_id,
                                   pad_id=self.tok.pad_id)
        mask = torch.from_numpy(np.stack([r[1] for r in rows])).float()
        batch.loss_mask.mul_(mask[:, 1:])
        T = batch.tokens.shape[1]
        if T >= 2:
            batch.mtp_loss_mask[:, :T - 1].mul_(mask[:, 2:])
        return batch


def build_chat_dataset(cfg: Any, tok: Any, split: str, num_samples: int | None) -> ChatDataset:
    """The loader's dataset for ``data.format: chat`` (not collective: every rank builds the same rows)."""
    return ChatDataset(str(cfg.data.path), tok, int(cfg.train.seq_len), int(cfg.train.seed), cfg.data.split, split,
                       num_samples, cfg.data.chat_overlong)
