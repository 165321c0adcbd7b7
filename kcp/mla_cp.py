"""Gated MLA under context parallelism: all-gather of the compressed per-token latent, and the causal work balanced
over the CP ranks by swapping half-segments of queries between rank pairs.

**Keys.** MLA caches one latent per token (``kv_lora_rank + qk_rope_head_dim`` = 576 numbers in K3) from which keys
and values of all heads are re-expanded (per key block, by the blockwise op), so the cheapest key exchange is the
latent itself: ONE all-gather of ``[B, T, 576]`` over the CP group per MLA layer (``(cp-1) * B * T * 576`` elements
per rank), against ``B * T * H * (192 + 128)`` for gathering expanded K and V (53x more in K3). Backward: ONE
reduce-scatter of the zero-padded ``[cp, B, T, L]`` latent gradient (:func:`kcp.comm.all_gather_autograd`).

**Queries: the causal balance.** Segments stay contiguous (KDA needs contiguous segments). With the queries of
rank ``r`` on its own segment, rank ``r`` attends over the keys of segments ``0..r``: ``r + 1/2`` units of
``T x T`` causal work for a single document spanning the row -- ``cp - 1/2`` on the last rank against a mean of
``cp/2`` (1.94x at cp = 16; at a 1M-token row that is seconds per MLA layer and micro-batch). With
``parallel.mla_cp_balance`` (the default) every rank instead computes its OWN first half-segment and its
PARTNER's second half-segment, partner ``p = cp - 1 - r``: half-segments ``2r`` and ``2p + 1`` of the row, whose
work is ``(2r + 1/2) + (2p + 3/2) = 2cp`` quarter-units on every rank -- exactly balanced (the middle rank of an
odd cp is its own partner and keeps its segment, also ``2cp``). The swap moves the MLA layer's INPUT ``x`` of the
second half to the partner (the partner runs the query projection, the gate, the attention and the output
projection on it -- its weights are the same dense replicas) and the layer's OUTPUT ``y`` back: per MLA layer and
rank ``B * T/2 * d`` elements sent and received twice forward (x out, y back) and twice backward (dy, dx), one
all-to-all each (a rank sends to its partner only; every rank joins, the middle rank sending to itself).

The designs weighed, per MLA layer at K3 (cp = 16, 1M-token row, T = 64K per rank, bf16; d = 7168, H = 96):

============================  ===========================================  ================================
design                        bytes moved per rank (forward, + the same    slowest rank's causal work
                              again backward)                              (units of T x T x H pairs)
============================  ===========================================  ================================
prefix only (before)          latent all-gather 1.13 GB                    15.5 (mean 8.0)
half-segment swap (this)      + x / y halves 2 x 0.47 GB out and in        8.0 (every rank)
general zigzag re-partition   the same bytes, but an all-to-all over all   8.0
                              ranks and a second KDA/MLA token order
splitting key-block work      q (2.4 KB) out + o and lse in fp32 (49.5 KB)  ~8.0, but 7x the swap's bytes per
                              per moved query token                        moved token and a merge by lse
============================  ===========================================  ================================

The swap adds 0.94 GB each way per MLA layer forward (about 19 ms on a 400 Gb/s inter-node link, the pairs
``(r, 15 - r)`` sit on different nodes of 8 GPUs) and saves 7.5 of 15.5 units on the slowest rank: at the
planner's H200 rate the attention of one unit is about 0.5 s forward, so about 4 s forward and 8 s backward per
MLA layer and micro-batch (``tools/plan.py`` models both, :func:`k3train.planning.step_time.comm.comm_per_layer`).

**Keys each rank keeps.** Rank ``r`` keeps the latents of segments ``0..max(r, p)`` (its own queries' prefix and
its partner's). Their doc ids: a rank knows every segment's edge summary (:mod:`kcp.edges`) and its own doc ids;
the partner's segment doc ids come with the context (one exchange of ``[B, T]`` int64 per micro-batch). Each
query group reads the keys' ids as its own segment would (:meth:`kcp.edges.SegmentEdges.seen_doc_ids`: exact for
the document its segment opens with, -1 elsewhere); an id that is not -1 is a token's true id in both views, so
the element-wise max of the two views is exact for both query groups at once.

Hang safety: the gather, the doc-id exchange and both swaps are unconditional and their backward collectives sit
on tensors every rank uses (the gathered prefix always holds the rank's own segment, which its own queries attend;
the swapped input feeds the query projection and the swapped output is the layer's output), so they run on every
rank whenever the layer output is used.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kcp.comm import CommStats, all_gather_autograd, group_size_rank, pg
from kcp.edges import NO_DOC, SegmentEdges


def balance_partner(rank: int, size: int) -> int:
    """The CP rank whose second half-segment of queries ``rank`` computes (and that computes ``rank``'s)."""
    return size - 1 - rank


def exchange_with_partner(x: Tensor, group: Any, partner: int, stats: CommStats | None = None,
                          kind: str = "") -> Tensor:
    """``x`` (any shape, the same on every rank) sent to ``partner``; returns the partner's ``x``. ONE
    ``all_to_all_single`` over ``group`` that every rank joins (rows of dim 0 go to the partner only; the middle
    rank of an odd group is its own partner). A copy of ``x`` without a group."""
    size, _ = group_size_rank(group)
    if size == 1:
        return x.clone()
    send = x.contiguous()
    recv = torch.empty_like(send)
    rows = send.shape[0]
    splits = [rows if i == partner else 0 for i in range(size)]
    dist.all_to_all_single(recv, send, splits, splits, group=pg(group))
    if stats is not None:
        stats.add(kind, send.numel() * send.element_size())
    return recv


class _SwapSecondHalves(torch.autograd.Function):
    """``x [B, T, *]`` -> ``[x[:, :h] ; partner's x[:, h:]]`` with ``h = T // 2``. The swap is its own inverse, so
    the backward swaps the gradient the same way (one all-to-all each way)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, partner: int, stats: CommStats | None, fwd_kind: str,
                bwd_kind: str) -> Tensor:
        ctx.group, ctx.partner, ctx.stats, ctx.bwd_kind = group, partner, stats, bwd_kind
        return _swap(x, group, partner, stats, fwd_kind)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _swap(grad, ctx.group, ctx.partner, ctx.stats, ctx.bwd_kind), None, None, None, None, None


def _swap(x: Tensor, group: Any, partner: int, stats: CommStats | None, kind: str) -> Tensor:
    h = x.shape[1] // 2
    # dim 0 of the exchanged block is B: [B, T - h, *] goes to the partner as one piece
    return torch.cat([x[:, :h], exchange_with_partner(x[:, h:], group, partner, stats, kind)], dim=1)


def swap_second_halves(x: Tensor, group: Any, partner: int, stats: CommStats | None = None, fwd_kind: str = "",
                       bwd_kind: str = "") -> Tensor:
    """Differentiable half-segment swap with ``partner`` (see :class:`_SwapSecondHalves`). Collective over
    ``group`` forward and backward, on every rank."""
    if x.dim() < 2:
        raise ValueError(f"swap_second_halves: x must be [B, T, ...], got {tuple(x.shape)}")
    return _SwapSecondHalves.apply(x, group, partner, stats, fwd_kind, bwd_kind)


def balanced_key_doc_ids(edges: SegmentEdges, rank: int, own_doc: Tensor, partner: int,
                         partner_doc: Tensor) -> Tensor:
    """``[max(rank, partner) + 1, B, T]`` key doc ids exact for both query groups of a balanced rank (module
    docstring): the element-wise max of ``rank``'s and ``partner``'s views of segments ``0..max(rank, partner)``,
    each padded with :data:`~kcp.edges.NO_DOC` beyond its own segment."""
    n = max(rank, partner) + 1
    views = []
    for r, doc in ((rank, own_doc), (partner, partner_doc)):
        v = edges.seen_doc_ids(r, doc)
        if v.shape[0] < n:
            v = torch.cat([v, v.new_full((n - v.shape[0],) + tuple(v.shape[1:]), NO_DOC)])
        views.append(v)
    return torch.maximum(views[0], views[1])


def gather_latent_prefix(latent: Tensor, key_doc_ids: Tensor, key_positions: Tensor, group: Any,
                         stats: CommStats | None = None, segments: int | None = None
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """All-gather this rank's MLA latents over the CP group, keep the first ``segments`` segments (default: the
    causal prefix ``0..rank``; a balanced rank keeps ``0..max(rank, partner)``).

    Args: latent ``[B, T, L]``; key_doc_ids / key_positions ``[B, segments*T]`` the kept keys' doc ids and row
    positions (precomputed once per micro-batch by :class:`kcp.KCPContext` from the segment edge summaries,
    :mod:`kcp.edges`). Returns ``(latent_keys [B, segments*T, L], key_doc_ids, key_positions)``; mask with
    ``key_pos <= query_pos and key_doc == query_doc``. Collective over ``group`` (all-gather fwd, reduce-scatter bwd).
    """
    if latent.dim() != 3:
        raise ValueError(f"gather_latent: latent must be [B, T, L], got {tuple(latent.shape)}")
    _, rank = group_size_rank(group)
    n = rank + 1 if segments is None else segments
    B, T, L = latent.shape
    allv = all_gather_autograd(latent, group, stats, "mla_fwd", "mla_bwd")  # [cp, B, T, L]
    out = allv[:n].transpose(0, 1).reshape(B, n * T, L)
    if out.shape[1] != key_doc_ids.shape[1]:
        raise ValueError(f"gather_latent: latent gives {out.shape[1]} keys but the context has "
                         f"{key_doc_ids.shape[1]} (was the context built for this micro-batch?)")
    return out, key_doc_ids, key_positions
