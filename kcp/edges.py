"""Segment edge summaries: the per-row document facts KCP exchanges instead of every token's doc id and position.

What the KCP pieces need to know about the OTHER ranks' segments of a row:

* the KDA fold (:mod:`kcp.fold`): the doc id of each segment's first and last token and whether a document starts
  inside it (``SegmentDocs``);
* the ShortConv halo and the MLA key mask (:mod:`kcp.halo`, :mod:`kcp.mla_cp`): for a token of an earlier segment,
  whether it belongs to the document this rank's segment opens with -- the ONLY document of this rank that
  can reach back across the boundary, since a document is one contiguous run of a row and doc ids do not
  decrease along the row (``doc_ids`` is a running EOS count, :mod:`k3train.data.batch`) -- and its position.
  In segment ``j`` the tokens of that document are exactly those from ``j``'s last document start on (its
  trailing part) when ``j``'s last doc id is that document's, none otherwise; positions are consecutive within a
  segment, so the first position gives them all.

So every rank contributes one fixed-size row per batch row, ``EDGE_FIELDS`` = (first doc id, last doc id, local
index of the last document start (0: none inside), first position, well-formed flag), ``[B, 5]`` int64:
``(cp - 1) * B * 40`` bytes moved per rank and micro-batch, against ``(cp - 1) * B * T * 16`` for all-gathering
``doc_ids`` and ``positions``. The flag says this rank's rows are well formed (non-negative, non-decreasing doc
ids, consecutive positions); it travels in the same all-gather so that every rank raises the same error, never
some ranks only (a rank that raised alone would leave the others waiting in the next collective).

The doc ids this rank then reports for earlier segments' tokens are exact for its first document and ``-1`` (no
document of this rank) for every other token: equality with this rank's doc ids -- all the conv and the
attention mask ask of them -- is the same as with the true ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kcp.fold import SegmentDocs

EDGE_FIELDS = ("first_doc", "last_doc", "last_start", "first_pos", "ok")
NO_DOC = -1  # doc id of a token that belongs to no document of the reading rank (and of padding before row start)


def local_edges(doc_ids: Tensor, positions: Tensor) -> Tensor:
    """This rank's summary ``[B, len(EDGE_FIELDS)]`` int64 of ``doc_ids`` / ``positions`` ``[B, T]``."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device)
    starts = torch.zeros_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).amax(dim=1)
    ok = ((doc_ids[:, 1:] >= doc_ids[:, :-1]).all(dim=1) & (doc_ids[:, 0] >= 0)
          & (positions == positions[:, :1] + idx).all(dim=1))
    return torch.stack([doc_ids[:, 0], doc_ids[:, -1], last_start, positions[:, 0], ok.long()], dim=1)


@dataclass(frozen=True)
class SegmentEdges:
    """Every CP rank's edge summary of one micro-batch (all fields ``[cp, B]`` int64, identical on every rank)
    and the segment length ``T``."""

    first_doc: Tensor
    last_doc: Tensor
    last_start: Tensor
    first_pos: Tensor
    T: int

    @classmethod
    def from_gathered(cls, gathered: Tensor, T: int) -> "SegmentEdges":
        """``gathered [cp, B, len(EDGE_FIELDS)]`` (rank order). Raises ValueError -- on every rank alike -- if some
        rank's rows are malformed or doc ids decrease across a segment boundary."""
        first, last, start, pos, ok = gathered.unbind(-1)
        bad = (ok == 0).nonzero().tolist()
        if bad:
            raise ValueError(f"KCPContext: (cp rank, row) {bad[:4]}: every segment needs non-negative, "
                             "non-decreasing doc ids (a document is one contiguous run of its row) and consecutive "
                             "row positions")
        if first.shape[0] > 1 and not bool((last[:-1] <= first[1:]).all()):
            raise ValueError("KCPContext: doc ids decrease across a CP segment boundary (documents must be "
                             "contiguous runs of the row, numbered in order)")
        return cls(first_doc=first, last_doc=last, last_start=start, first_pos=pos, T=T)

    def segment_docs(self) -> SegmentDocs:
        """The fold's document facts (:class:`kcp.fold.SegmentDocs`)."""
        return SegmentDocs(first=self.first_doc, last=self.last_doc, inner_start=self.last_start > 0)

    def seen_doc_ids(self, rank: int, own: Tensor) -> Tensor:
        """``[rank + 1, B, T]`` doc ids of segments ``0..rank`` as ``rank`` sees them: its own (``own [B, T]``)
        exact; an earlier segment's token gets the reading rank's first doc id where it belongs to that document
        (the trailing part of a segment whose last doc id is it), else :data:`NO_DOC` (module docstring)."""
        idx = torch.arange(self.T, device=own.device)
        mine = self.first_doc[rank].to(own.device)  # [B]
        last, start = self.last_doc[:rank].to(own.device), self.last_start[:rank].to(own.device)  # [rank, B]
        inside = (last == mine)[..., None] & (idx >= start[..., None])  # [rank, B, T]
        earlier = torch.where(inside, mine[None, :, None].expand_as(inside), torch.full_like(inside, NO_DOC,
                                                                                            dtype=own.dtype))
        return torch.cat([earlier.to(own.dtype), own[None]], dim=0)

    def positions(self, rank: int, device: torch.device) -> Tensor:
        """``[rank + 1, B, T]`` row positions of segments ``0..rank`` (first position + local index)."""
        return self.first_pos[: rank + 1].to(device)[..., None] + torch.arange(self.T, device=device)
