"""The training micro-batch: tokens, shifted labels, masks and the document layout of every row.

A row is built from one packed sample of ``T + 1`` tokens (Megatron's GPTDataset packs EOS-terminated
documents back to back, so a row can start in the middle of a document and hold several documents).

Conventions (``x`` = the ``T + 1`` sample tokens, ``t`` in ``0..T-1``):

* ``tokens[t] = x[t]``, ``labels[t] = x[t + 1]``.
* ``doc_ids[t]`` = number of EOS tokens in ``x[0..t-1]``: a token right after an EOS starts a new document;
  the EOS itself belongs to the document it ends. Numbering restarts at 0 on every row.
* ``loss_mask[t] = 0`` where ``x[t]`` is EOS: predicting the first token of the NEXT document from an EOS is
  meaningless. Predicting the EOS itself (``labels[t] == EOS``) is trained.
* ``mtp_labels[t] = x[t + 2]`` (multi-token prediction, depth 1). ``mtp_loss_mask[t] = 0`` when ``t + 2 > T``
  (outside the sample; ``mtp_labels`` holds ``fill_id`` there) or when ``x[t + 2]`` is in another document
  than ``x[t]`` (``x[t]`` or ``x[t + 1]`` is EOS).
* ``positions[t] = t``: positions are NOT reset per document; attention layers isolate documents with
  ``doc_ids``.
* ``pad_id`` (optional): positions whose token or label is padding get both masks 0 (Megatron only pads
  the final partial validation sample; training samples are always full).

Under context parallelism every CP rank gets a contiguous slice of every row (:meth:`Batch.slice_cp`); the
masks and labels are computed on the full row first, so slicing never changes a token's targets, and
``doc_ids`` / ``positions`` keep their full-row meaning.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Batch:
    """One micro-batch. All fields are ``[B, T]``; ``loss_mask``/``mtp_loss_mask`` float32, the rest int64."""

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    doc_ids: Tensor
    positions: Tensor
    mtp_labels: Tensor
    mtp_loss_mask: Tensor

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_samples(cls, samples: Tensor, eos_id: int, pad_id: int | None = None, fill_id: int = 0) -> "Batch":
        """Build a batch from packed samples ``[B, T + 1]`` (int). See the module docstring for the rules."""
        if samples.dim() != 2 or samples.shape[1] < 2:
            raise ValueError(f"samples must be [B, T+1] with T >= 1, got shape {tuple(samples.shape)}")
        x = samples.long()
        B, T = x.shape[0], x.shape[1] - 1
        tokens, labels = x[:, :T], x[:, 1:]
        is_eos = tokens == eos_id
        # exclusive cumulative count of EOS: the token after an EOS opens document k+1
        doc_ids = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
        loss_mask = (~is_eos).float()

        mtp_labels = torch.full((B, T), fill_id, dtype=torch.long)
        mtp_loss_mask = torch.zeros(B, T)
        if T >= 2:
            mtp_labels[:, : T - 1] = x[:, 2:]
            same_doc = ~(is_eos[:, : T - 1] | is_eos[:, 1:T])  # no EOS at t or t+1
            mtp_loss_mask[:, : T - 1] = same_doc.float()
        if pad_id is not None:
            pad = (tokens == pad_id) | (labels == pad_id)
            loss_mask = loss_mask.masked_fill(pad, 0.0)
            mtp_pad = pad.clone()
            mtp_pad[:, : T - 1] |= mtp_labels[:, : T - 1] == pad_id
            mtp_loss_mask = mtp_loss_mask.masked_fill(mtp_pad, 0.0)
        positions = torch.arange(T, dtype=torch.long).expand(B, T).contiguous()
        return cls(tokens.contiguous(), labels.contiguous(), loss_mask, doc_ids, positions, mtp_labels,
                   mtp_loss_mask)

    # ------------------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    def _map(self, fn) -> "Batch":
        return Batch(**{f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """Move every field to ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def slice_cp(self, cp_rank: int, cp: int) -> "Batch":
        """This CP rank's contiguous segment ``[cp_rank*T/cp, (cp_rank+1)*T/cp)`` of every row.
        ``doc_ids`` and ``positions`` keep their full-row values."""
        T = self.tokens.shape[1]
        if cp < 1 or not 0 <= cp_rank < cp:
            raise ValueError(f"bad CP coordinates cp_rank={cp_rank}, cp={cp}")
        if T % cp:
            raise ValueError(f"sequence length {T} is not divisible by cp={cp}")
        n = T // cp
        return self._map(lambda t: t[:, cp_rank * n:(cp_rank + 1) * n].contiguous())

    def micro_batches(self, mbs: int) -> list["Batch"]:
        """Split the rows into consecutive micro-batches of ``mbs`` rows (B must be divisible by mbs)."""
        B = self.tokens.shape[0]
        if mbs < 1 or B % mbs:
            raise ValueError(f"batch of {B} rows cannot be split into micro-batches of {mbs}")
        return [self._map(lambda t, i=i: t[i:i + mbs]) for i in range(0, B, mbs)]

    @staticmethod
    def cat(batches: list["Batch"], dim: int = 0) -> "Batch":
        """Concatenate batches along rows (``dim=0``) or along the sequence (``dim=1``, e.g. CP slices)."""
        return Batch(**{f.name: torch.cat([getattr(b, f.name) for b in batches], dim=dim)
                        for f in dataclasses.fields(Batch)})

    def num_lm_tokens(self) -> int:
        """Number of tokens that contribute to the next-token loss."""
        return int(self.loss_mask.sum().item())

    def num_mtp_tokens(self) -> int:
        """Number of tokens that contribute to the MTP (t+2) loss."""
        return int(self.mtp_loss_mask.sum().item())
