"""Replica gradient reduce-back (spec "MoonEP": backward puts redundant experts' gradients into a local reduce
buffer and reduces them back into the owner's gradient buffer).

The replica weights are not parameters: their gradients (from the replica FFN's backward) are sent back to the
owner, which adds them into the gradient it returns for its own ``w_gate / w_up / w_down`` shard; autograd then
accumulates that into ``param.grad``. Parameters and optimizer state therefore exist only on owners.

Point-to-point over the EP weight group, the prefetch schedule reversed: each host sends its slots to their one
home rank; an owner receives one message per (host, slot) of its experts into a persistent receive buffer
(grow-only, reused across layers and steps: it is consumed before the backward call returns). The owner adds the
received pieces in (host rank, slot) order, so the sum is deterministic.
"""
from __future__ import annotations

from typing import Any

import torch

from moonep.comm import CommBuffers, p2p_batch
from moonep.layout import RankLayout
from moonep.prefetch import N_MATRICES, replica_tag


def start_reduce_back(layout: RankLayout, replica_grads: tuple[torch.Tensor, ...], group: Any, ranks: list[int],
                      buffers: CommBuffers) -> tuple[list[torch.Tensor], list[Any]]:
    """Start sending this rank's replica-slot gradients home and receiving its experts' replica gradients.

    ``replica_grads``: ``(g_gate[n, l, f], g_up[n, l, f], g_down[n, f, l])``. Returns ``(incoming, handles)``;
    ``incoming[m]`` is ``[len(layout.prefetch_sends), ...]`` for matrix ``m`` once ``handles`` are waited.
    """
    n_in = len(layout.prefetch_sends)
    incoming = []
    for m, g in enumerate(replica_grads):
        shape = tuple(g.shape[1:])
        flat = buffers.get(f"reduce{m}", n_in, shape[0] * shape[1], g.dtype, g.device)
        incoming.append(flat.view((n_in,) + shape))
    sends = [(replica_grads[m][t.slot].contiguous(), ranks[t.src], replica_tag(t.slot, m))
             for t in layout.prefetch_recvs for m in range(N_MATRICES)]
    recvs = [(incoming[m][i], ranks[t.dst], replica_tag(t.slot, m))
             for i, t in enumerate(layout.prefetch_sends) for m in range(N_MATRICES)]
    return incoming, p2p_batch(sends, recvs, group)


def finish_reduce_back(layout: RankLayout, incoming: list[torch.Tensor], local_grads: tuple[torch.Tensor, ...],
                       experts_per_rank: int) -> None:
    """Add the received replica gradients into ``local_grads`` (this rank's ``[n, ...]`` shard grads, in place),
    in (host, slot) order -- ``layout.prefetch_sends`` is sorted that way."""
    base = layout.me * experts_per_rank
    for i, t in enumerate(layout.prefetch_sends):
        for m in range(N_MATRICES):
            local_grads[m][t.expert - base] += incoming[m][i]


def reduce_back_reference(layout_by_rank: list[RankLayout], replica_grads_by_rank: list[tuple[torch.Tensor, ...]],
                          num_experts: int) -> list[torch.Tensor]:
    """Readable reference (tests): the full ``[E, ., .]`` gradient contribution of every replica slot of every rank."""
    shapes = [tuple(g.shape[1:]) for g in replica_grads_by_rank[0]]
    full = [replica_grads_by_rank[0][m].new_zeros((num_experts,) + shapes[m]) for m in range(N_MATRICES)]
    for layout, grads in zip(layout_by_rank, replica_grads_by_rank):
        for t in layout.prefetch_recvs:
            for m in range(N_MATRICES):
                full[m][t.expert] += grads[m][t.slot]
    return full
