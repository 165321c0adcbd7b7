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

Multimodal runs (``data.format: multimodal``, :mod:`k3train.data.multimodal`): ``media`` holds the images / clips
of the micro-batch's rows (:class:`k3train.model.media.MediaInputs`, row-major ``[B, T]`` placeholder order;
``MediaInputs.empty()`` when the rows hold none, never None, so every rank runs the same program) and
``media_rows[i]`` the row of media ``i`` (used to split rows into micro-batches), ``media_token_id`` the
placeholder id the media fill. :meth:`slice_cp` keeps the media WHOLE on every CP rank and records
``media_offsets[b]``: the index, in the micro-batch's media embeddings (row-major placeholder order of the FULL
rows), of row ``b``'s first placeholder inside the slice -- the model side encodes all media and scatters the
embeddings ``media_offsets[b] + 0, 1, ...`` into row ``b``'s placeholders (:meth:`K3Model.embed_batch`).
Text-only runs leave all four None.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from k3train.model.media import MediaInputs

if TYPE_CHECKING:  # imported where used: k3train.model's package imports the whole model
    from k3train.model.media import MediaInputs

_ROW_FIELDS = ("tokens", "labels", "loss_mask", "doc_ids", "positions", "mtp_labels", "mtp_loss_mask")


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
    media: MediaInputs | None = None  # multimodal runs: this micro-batch's media (module docstring)
    media_rows: Tensor | None = None  # [n_media] int64: the row of each media
    media_token_id: int | None = None  # the placeholder id the media fill (slice_cp counts placeholders by it)
    media_offsets: Tensor | None = None  # [B] int64, CP slices only: see the module docstring
    # CP slices with vision.cp_split_min_patches > 0: the micro-batch's kcp.vision_cp.VisionCPContext (the
    # encoding shared by the CP ranks), attached by k3train.parallelize.make_seq_builder
    vision_cp: Any = None

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
        """``fn`` applied to every ``[B, T]`` field; the media are carried over unchanged."""
        return dataclasses.replace(self, **{k: fn(getattr(self, k)) for k in _ROW_FIELDS})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """Move every field (media included) to ``device``."""
        out = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        if self.media is not None:
            out.media = self.media.to(device)
            out.media_rows = self.media_rows.to(device) if self.media_rows is not None else None
            out.media_offsets = self.media_offsets.to(device) if self.media_offsets is not None else None
        return out

    def slice_cp(self, cp_rank: int, cp: int) -> "Batch":
        """This CP rank's contiguous segment ``[cp_rank*T/cp, (cp_rank+1)*T/cp)`` of every row.
        ``doc_ids`` and ``positions`` keep their full-row values."""
        T = self.tokens.shape[1]
        if cp < 1 or not 0 <= cp_rank < cp:
            raise ValueError(f"bad CP coordinates cp_rank={cp_rank}, cp={cp}")
        if T % cp:
            raise ValueError(f"sequence length {T} is not divisible by cp={cp}")
        n = T // cp
        out = self._map(lambda t: t[:, cp_rank * n:(cp_rank + 1) * n].contiguous())
        if self.media is not None:
            out.media_offsets = self._media_offsets_at(cp_rank * n)
        return out

    def _media_offsets_at(self, col: int) -> Tensor:
        """Per row ``b``: placeholders of the rows before ``b`` plus those of row ``b`` before column ``col``
        (the full-row index of the first media embedding a slice starting at ``col`` places in row ``b``)."""
        if self.media_offsets is not None:
            raise ValueError("slice_cp() of a batch that is already a CP slice")
        if self.media_token_id is None:
            raise ValueError("slice_cp() of a batch with media needs media_token_id (the placeholder id) to "
                             "locate its placeholders")
        ph = (self.tokens == self.media_token_id).long()
        per_row = ph.sum(dim=1)
        return per_row.cumsum(0) - per_row + ph[:, :col].sum(dim=1)

    def micro_batches(self, mbs: int) -> list["Batch"]:
        """Split the rows into consecutive micro-batches of ``mbs`` rows (B must be divisible by mbs)."""
        B = self.tokens.shape[0]
        if mbs < 1 or B % mbs:
            raise ValueError(f"batch of {B} rows cannot be split into micro-batches of {mbs}")
        return [self._rows(i, i + mbs) for i in range(0, B, mbs)]

    def _rows(self, lo: int, hi: int) -> "Batch":
        """Rows ``[lo, hi)`` with their media."""
        out = self._map(lambda t: t[lo:hi])
        if self.media is None:
            return out
        if self.media_offsets is not None:
            raise ValueError("split the rows into micro-batches before slicing them for CP (media_offsets count "
                             "the placeholders of all rows)")
        if self.media_rows is None:
            raise ValueError("a batch with media needs media_rows to be split into micro-batches")

        patches = self.media.grid_thw.prod(dim=1)
        first = torch.cat([torch.zeros(1, dtype=torch.long), patches.cumsum(0)])
        sel = torch.nonzero((self.media_rows >= lo) & (self.media_rows < hi)).flatten()
        if sel.numel() == 0:
            out.media, out.media_rows = MediaInputs.empty(self.media.pixel_values.shape[-1],
                                                          self.media.pixel_values.dtype), sel
            return out
        a, b = int(sel[0]), int(sel[-1]) + 1  # media of consecutive rows are consecutive
        out.media = MediaInputs(self.media.pixel_values[int(first[a]):int(first[b])], self.media.grid_thw[a:b])
        out.media_rows = self.media_rows[a:b] - lo
        return out

    @staticmethod
    def cat(batches: list["Batch"], dim: int = 0) -> "Batch":
        """Concatenate batches along rows (``dim=0``) or along the sequence (``dim=1``, e.g. CP slices; their
        media, whole on every CP rank, must be equal and are kept once)."""
        out = Batch(**{k: torch.cat([getattr(b, k) for b in batches], dim=dim) for k in _ROW_FIELDS})
        media = [b.media for b in batches]
        if all(m is None for m in media):
            return out
        out.media_token_id = batches[0].media_token_id
        if dim == 0 and any(b.media_offsets is not None for b in batches):
            raise ValueError("cannot concatenate the rows of CP slices (concatenate along the sequence first)")
        if any(m is None or b.media_rows is None for m, b in zip(media, batches)):
            raise ValueError("cannot concatenate batches with and without media")
        if dim == 1:
            m0 = media[0]
            for m in media[1:]:
                if not (torch.equal(m.grid_thw, m0.grid_thw) and torch.equal(m.pixel_values, m0.pixel_values)):
                    raise ValueError("CP slices of one micro-batch must carry the same media")
            out.media, out.media_rows = m0, batches[0].media_rows
            return out

        offsets = torch.tensor([0] + [b.tokens.shape[0] for b in batches]).cumsum(0)
        out.media = MediaInputs(torch.cat([m.pixel_values for m in media]), torch.cat([m.grid_thw for m in media]))
        out.media_rows = torch.cat([b.media_rows + int(o) for b, o in zip(batches, offsets)])
        return out

    def num_lm_tokens(self) -> int:
        """Number of tokens that contribute to the next-token loss."""
        return int(self.loss_mask.sum().item())

    def num_mtp_tokens(self) -> int:
        """Number of tokens that contribute to the MTP (t+2) loss."""
        return int(self.mtp_loss_mask.sum().item())
