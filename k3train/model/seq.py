"""``SeqInfo``: the sequence layout of one micro-batch on THIS rank (documents packed into rows).

Every sequence mixer needs the same three facts about the packed rows: which document each token belongs to
(ShortConv and attention must not look across a document boundary), each token's position in the FULL row
(under context parallelism a rank holds a contiguous segment, so local index != position), and the
variable-length segment offsets over the flattened ``[1, B*T]`` layout the KDA kernel consumes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SeqInfo:
    """Layout of a ``[B, T]`` micro-batch (T = the local segment length under CP).

    Attributes:
        doc_ids: ``LongTensor[B, T]`` document index per token. Under CP every rank holding a segment of the same
            row uses the same numbering, so equal ids across ranks mean "same document".
        positions: ``LongTensor[B, T]`` position of each token within the full row (0..T_full-1).
        cu_seqlens: ``IntTensor[n+1]`` (int32) cumulative offsets over the flattened ``B*T`` local tokens; every
            row start and every document start is a boundary, ``cu_seqlens[0] = 0``, ``cu_seqlens[-1] = B*T``.
        cp: a KCP context object (``conv_halo``, ``kda``, ``gather_latent``), or ``None`` without CP.
    """

    doc_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    cp: Any = None

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor, positions: torch.Tensor | None = None, cp: Any = None) -> "SeqInfo":
        """Build the layout from per-token document ids ``[B, T]``.

        ``positions`` defaults to ``0..T-1`` in every row (correct without CP; under CP the caller passes the
        full-row positions of its segment).
        """
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be [B, T], got shape {tuple(doc_ids.shape)}")
        doc_ids = doc_ids.long()
        B, T = doc_ids.shape
        if positions is None:
            positions = torch.arange(T, device=doc_ids.device).expand(B, T)
        elif positions.shape != doc_ids.shape:
            raise ValueError(f"positions shape {tuple(positions.shape)} != doc_ids shape {tuple(doc_ids.shape)}")
        return cls(doc_ids=doc_ids, positions=positions.long(), cu_seqlens=cu_seqlens_from_doc_ids(doc_ids), cp=cp)

    @property
    def batch_size(self) -> int:
        return self.doc_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.doc_ids.shape[1]

    @property
    def max_seqlen(self) -> int:
        """Longest segment in ``cu_seqlens`` (what varlen kernels size their grid by)."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max().item())


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Segment offsets over the flattened ``[B*T]`` tokens: a boundary at every row start and document change.

    Returns int32 on ``doc_ids``' device (the dtype variable-length kernels take).
    """
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    if T > 1:
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = torch.nonzero(starts.reshape(-1), as_tuple=False).squeeze(1)
    end = torch.tensor([B * T], device=doc_ids.device, dtype=idx.dtype)
    return torch.cat([idx, end]).to(torch.int32)
