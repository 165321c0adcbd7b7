"""ShortConv halo exchange under context parallelism.

KDA's causal depthwise conv (kernel 4) needs, for the first ``n = kernel - 1`` tokens of a rank's segment, the last
``n`` tokens of the previous rank's segment of the same row. Forward: every rank sends ``x[:, -n:]`` to the next
CP rank and receives the previous rank's (rank 0 gets zeros with doc id -1, so the conv treats them as "no
token"). Backward is the mirror: every rank sends ``dL/dprev`` back to the previous rank, which adds it to the
gradient of its own last ``n`` positions. Point-to-point over the CP group: ``B * n * C`` elements per rank and
direction (3 tokens' channels per row in K3), independent of the sequence length.

Each rank posts its send and receive together (``batch_isend_irecv``), so the chain cannot deadlock; every rank
runs the exchange (rank 0 only sends, the last rank only receives) at the same point of the layer, forward and
backward.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kcp.comm import CommStats, group_size_rank


def _shift(send: Tensor | None, recv_shape: tuple[int, ...], like: Tensor, group: Any, to_next: bool,
           stats: CommStats | None, kind: str) -> Tensor:
    """Send ``send`` to the next (``to_next``) or previous rank; receive the matching tensor from the other side.

    Returns the received tensor, or zeros where there is no neighbour on that side.
    """
    size, rank = group_size_rank(group)
    src = rank - 1 if to_next else rank + 1
    dst = rank + 1 if to_next else rank - 1
    recv = like.new_zeros(recv_shape)
    if size == 1:
        return recv
    ops = []
    if 0 <= dst < size and send is not None:
        buf = send.contiguous()
        ops.append(dist.P2POp(dist.isend, buf, dist.get_global_rank(group, dst), group=group))
        if stats is not None:
            stats.add(kind, buf.numel() * buf.element_size())
    if 0 <= src < size:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, src), group=group))
    if ops:  # batched: NCCL posts the neighbour pair together
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return recv


class HaloExchange(torch.autograd.Function):
    """``x [B, T, C] -> prev [B, n, C]``: the previous CP rank's last ``n`` positions of every row (autograd)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, n: int, group: Any, stats: CommStats | None) -> Tensor:
        B, T, C = x.shape
        ctx.n, ctx.group, ctx.stats, ctx.shape = n, group, stats, x.shape
        return _shift(x[:, T - n:], (B, n, C), x, group, True, stats, "halo_fwd")

    @staticmethod
    def backward(ctx: Any, grad_prev: Tensor) -> tuple[Tensor | None, ...]:
        B, T, C = ctx.shape
        n = ctx.n
        _, rank = group_size_rank(ctx.group)
        # rank 0's halo was constant zeros: its gradient goes nowhere
        tail = _shift(grad_prev if rank > 0 else None, (B, n, C), grad_prev, ctx.group, False, ctx.stats,
                      "halo_bwd")
        grad_x = grad_prev.new_zeros(B, T, C)
        grad_x[:, T - n:] = tail
        return grad_x, None, None, None


def conv_halo(x: Tensor, n: int, prev_doc: Tensor, group: Any, stats: CommStats | None = None) -> tuple[Tensor, Tensor]:
    """The previous CP rank's last ``n`` positions of ``x``.

    Args: x ``[B, T, C]`` (T >= n), n >= 0, prev_doc ``[B, >= n]`` doc ids of the previous rank's last positions
    (``-1`` where there is no previous rank), group: the CP group.
    Returns ``(prev [B, n, C], prev_doc [B, n])``; p2p over ``group`` in forward and backward.
    """
    if x.dim() != 3:
        raise ValueError(f"conv_halo: x must be [B, T, C], got {tuple(x.shape)}")
    if not 0 <= n <= x.shape[1]:
        raise ValueError(f"conv_halo: halo width n={n} must be in [0, T={x.shape[1]}] (segment too short)")
    if n == 0:
        return x.new_zeros(x.shape[0], 0, x.shape[2]), prev_doc[:, :0]
    return HaloExchange.apply(x, n, group, stats), prev_doc[:, prev_doc.shape[1] - n:]
