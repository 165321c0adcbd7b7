"""ShortConv halo exchange under context parallelism, for any segment length.

KDA's causal depthwise conv (kernel 4) needs, for the first ``n = kernel - 1`` tokens of a rank's segment, the
``n`` tokens of the row that precede the segment. When a segment is at least ``n`` long they are the previous
rank's last ``n`` tokens; when it is shorter (``seq_len / cp < n``, e.g. segments of 2 with kernel 4) they span
several earlier ranks. One rule covers both: every rank contributes its last ``m = min(n, T)`` tokens to ONE
all-gather over the CP group (``[cp, B, m, C]``); rank r's halo is the last ``n`` tokens of ranks ``0..r-1``'s
contributions laid end to end, padded in front with zeros (doc id -1: "no token", the conv ignores them). With
``m = T`` the contributions are whole segments, so the window is exact however far back it reaches.

Backward: the gradient of the window scatters back into the ``[cp, B, m, C]`` gather (zeros where unused) and ONE
reduce-scatter returns to each rank the sum of what every later rank sent for its tail. Bytes per rank and
direction: ``(cp - 1) * B * m * C`` elements (3 tokens' channels per row and earlier rank in K3), independent of
the sequence length.

Hang safety: every rank runs the same all-gather forward and reduce-scatter backward (rank 0 too, whose window is
all padding): the window is :func:`kcp.comm.tie`-d to the gathered tensor, so its backward runs on every rank
whenever the halo is used; :class:`kcp.KCPContext` also ties each halo into the layer's KDA output.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kcp.comm import CommStats, all_gather_autograd, group_size_rank, tie


def halo_window(tails: Tensor, rank: int, n: int, fill: float | int) -> Tensor:
    """``tails [cp, B, m, *]`` (every rank's last m positions, rank order) -> ``[B, n, *]``: the n positions that
    precede ``rank``'s segment, ``fill`` where the row has fewer than n earlier positions. Differentiable."""
    cp, B, m = tails.shape[:3]
    rest = tuple(tails.shape[3:])
    before = tails[:rank].transpose(0, 1).reshape((B, rank * m) + rest)
    pad = tails.new_full((B, max(0, n - rank * m)) + rest, fill)
    window = torch.cat([pad, before], dim=1)
    return window[:, window.shape[1] - n:]


def halo_doc_ids(doc_ids_all: Tensor, rank: int, n: int) -> Tensor:
    """``doc_ids_all [>= rank, B, T]`` (the doc ids of segments 0..rank-1 at least, as ``rank`` sees them:
    :meth:`kcp.edges.SegmentEdges.seen_doc_ids`) -> ``[B, n]`` doc ids of ``rank``'s halo (-1: none, or a token
    of no document of this segment)."""
    m = min(n, doc_ids_all.shape[-1])
    return halo_window(doc_ids_all[..., doc_ids_all.shape[-1] - m:], rank, n, -1)


def conv_halo(x: Tensor, n: int, prev_doc: Tensor, group: Any, stats: CommStats | None = None) -> tuple[Tensor, Tensor]:
    """The ``n`` positions of every row that precede this rank's segment of ``x``.

    Args: x ``[B, T, C]`` (any T >= 1), n >= 0, prev_doc ``[B, n]`` their doc ids (:func:`halo_doc_ids`),
    group: the CP group.
    Returns ``(prev [B, n, C], prev_doc [B, n])``. Collective over ``group`` forward (all-gather) and backward
    (reduce-scatter) whenever n > 0, on every rank.
    """
    if x.dim() != 3:
        raise ValueError(f"conv_halo: x must be [B, T, C], got {tuple(x.shape)}")
    B, T, C = x.shape
    if n < 0:
        raise ValueError(f"conv_halo: halo width n={n} must be >= 0")
    if tuple(prev_doc.shape) != (B, n):
        raise ValueError(f"conv_halo: prev_doc must be [B, n] = {(B, n)}, got {tuple(prev_doc.shape)}")
    if n == 0:
        return x.new_zeros(B, 0, C), prev_doc
    _, rank = group_size_rank(group)
    m = min(n, T)
    tails = all_gather_autograd(x[:, T - m:], group, stats, "halo_fwd", "halo_bwd")  # [cp, B, m, C]
    return tie(halo_window(tails, rank, n, 0.0), tails), prev_doc
