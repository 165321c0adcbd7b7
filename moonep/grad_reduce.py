"""Replica gradient reduce-back (spec "MoonEP": backward puts redundant experts' gradients into a local reduce
buffer and reduces them back into the owner's gradient buffer).

The replica weights are not parameters: their gradients (from the replica FFN's backward) are sent back to the
owner, which adds them into the gradient it returns for its own ``w_gate / w_up / w_down`` shard; autograd then
accumulates that into ``param.grad``. Parameters and optimizer state therefore exist only on owners.

Point-to-point over the EP weight group, the prefetch schedule reversed: each host sends its (at most ``n``)
slots to its one home rank. An owner may host replicas on up to ``R - 1`` ranks, so receiving everything at once
would need up to ``(R-1)*n`` expert-sized buffers (the whole expert layer at K3 scale). It receives in *rounds*
instead, one host per round: round ``r`` of owner ``h`` receives from the ``r``-th host of ``h`` (ascending rank),
and that host sends in round ``r``, so both ends of every message sit in the same round and the rounds can run
one after another on any backend without a cycle. Two rounds are in flight (round ``r + 1`` is posted before
round ``r`` is added), so the receive buffer is at most ``2 * n`` experts; it is allocated per round and freed
when the round has been added. The owner adds the pieces in (host rank, slot) order: the sum is deterministic.
"""
from __future__ import annotations

from typing import Any

import torch

from moonep.comm import p2p_batch, wait_all
from moonep.layout import RankLayout
from moonep.prefetch import N_MATRICES, replica_tag

REDUCE_TAG_BASE = 1 << 16  # reduce-back messages never share a tag with the prefetch


def reduce_tag(slot: int, matrix: int) -> int:
    return REDUCE_TAG_BASE + replica_tag(slot, matrix)


class ReduceBack:
    """The reduce-back of one dispatch: :meth:`start` posts round 0 (overlap it with other work), :meth:`finish`
    runs the remaining rounds and adds the received gradients into this rank's shard gradients.

    ``replica_grads``: ``(g_gate[n, l, f], g_up[n, l, f], g_down[n, f, l])`` of this rank's replica slots;
    ``group``: the EP weight group; ``ranks``: EP index -> global rank."""

    def __init__(self, layout: RankLayout, replica_grads: tuple[torch.Tensor, ...], group: Any,
                 ranks: list[int]) -> None:
        self.lay, self.group, self.ranks = layout, group, ranks
        self.shapes = [tuple(g.shape[1:]) for g in replica_grads]
        self.like = replica_grads[0]
        hosts = sorted({t.dst for t in layout.prefetch_sends})
        self.by_round = [[t for t in layout.prefetch_sends if t.dst == d] for d in hosts]
        self.send_round = layout.reduce_round
        self.num_rounds = max(len(hosts), self.send_round + 1)
        self.sends = [(replica_grads[m][t.slot].contiguous(), ranks[t.src], reduce_tag(t.slot, m))
                      for t in layout.prefetch_recvs for m in range(N_MATRICES)]
        self.peak_rows = 0  # most expert slots held in receive buffers at once (tests)
        self._cur: tuple | None = None

    def _post(self, r: int) -> tuple:
        ts = self.by_round[r] if r < len(self.by_round) else []
        incoming = [self.like.new_empty((len(ts),) + shape) for shape in self.shapes]
        recvs = [(incoming[m][i], self.ranks[t.dst], reduce_tag(t.slot, m))
                 for i, t in enumerate(ts) for m in range(N_MATRICES)]
        sends = self.sends if r == self.send_round else []
        return p2p_batch(sends, recvs, self.group), incoming, ts

    def start(self) -> None:
        if self.num_rounds > 0:
            self._cur = self._post(0)

    def finish(self, local_grads: tuple[torch.Tensor, ...], experts_per_rank: int) -> None:
        """Run every round; add round ``r``'s gradients into ``local_grads`` (in place) while ``r + 1`` travels."""
        base = self.lay.me * experts_per_rank
        for r in range(self.num_rounds):
            nxt = self._post(r + 1) if r + 1 < self.num_rounds else None
            handles, incoming, ts = self._cur
            self.peak_rows = max(self.peak_rows, len(ts) + (len(nxt[2]) if nxt is not None else 0))
            wait_all(handles)
            for i, t in enumerate(ts):
                for m in range(N_MATRICES):
                    local_grads[m][t.expert - base] += incoming[m][i]
            self._cur = nxt


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
