"""Replica weight prefetch: copy the planned experts' ``w_gate, w_up, w_down`` from their owners into the hosting
ranks' replica slots (spec "MoonEP": plan online, prefetch before expert compute).

Point-to-point over the EP weight group (a second process group over the EP ranks, so the transfer runs
concurrently with the token all-to-all on gloo and NCCL alike). Zero-copy on both ends: the owner sends the
parameter slice ``w[j]`` itself (contiguous in the stacked ``[n, l, f]`` layout), the host receives straight into
its slot of the replica tensors. A host receives from one home group only (planner guarantee), so at most ``n``
slots per rank.

The dispatcher receives into the banks of :class:`moonep.replica_pool.ReplicaPool` (fixed ``[n, l, f]``
buffers shared by all MoE layers, refilled per layer in forward and again for its backward):
:func:`start_prefetch_into`. :func:`start_prefetch` receives into fresh tensors (unused slots zero).
"""
from __future__ import annotations

from typing import Any

import torch

from moonep.comm import p2p_batch
from moonep.layout import RankLayout

N_MATRICES = 3  # gate, up, down


def replica_tag(slot: int, matrix: int) -> int:
    return slot * N_MATRICES + matrix


def start_prefetch(layout: RankLayout, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], group: Any,
                   ranks: list[int], experts_per_rank: int) -> tuple[tuple[torch.Tensor, ...], list[Any]]:
    """Start the replica weight transfer of one dispatch.

    ``weights``: this rank's ``(w_gate[n, l, f], w_up[n, l, f], w_down[n, f, l])`` (the parameters' data).
    Returns ``(replicas, handles)``: ``replicas`` = three ``[n, ...]`` tensors whose slot ``s`` will hold
    ``layout.prefetch_recvs[s]``'s expert once ``handles`` are waited. Group: the EP weight group; ``ranks``
    maps EP index -> global rank.
    """
    n = experts_per_rank
    replicas = tuple(w.new_zeros((n,) + tuple(w.shape[1:])) for w in weights)
    return replicas, start_prefetch_into(replicas, layout, weights, group, ranks, n)


def start_prefetch_into(replicas: tuple[torch.Tensor, ...], layout: RankLayout, weights: tuple[torch.Tensor, ...],
                        group: Any, ranks: list[int], experts_per_rank: int) -> list[Any]:
    """:func:`start_prefetch` receiving into the given ``[n, ...]`` tensors (slots not in the plan keep their
    old values); returns the handles."""
    base = layout.me * experts_per_rank
    sends = [(w[t.expert - base], ranks[t.dst], replica_tag(t.slot, m))
             for t in layout.prefetch_sends for m, w in enumerate(weights)]
    recvs = [(replicas[m][t.slot], ranks[t.src], replica_tag(t.slot, m))
             for t in layout.prefetch_recvs for m in range(N_MATRICES)]
    return p2p_batch(sends, recvs, group)


def prefetch_reference(layout: RankLayout, all_weights: tuple[torch.Tensor, ...],
                       experts_per_rank: int) -> tuple[torch.Tensor, ...]:
    """Readable reference: the replica tensors built from the FULL ``[E, ., .]`` weights (tests)."""
    n = experts_per_rank
    out = tuple(w.new_zeros((n,) + tuple(w.shape[1:])) for w in all_weights)
    for t in layout.prefetch_recvs:
        for m, w in enumerate(all_weights):
            out[m][t.slot] = w[t.expert]
    return out


def weight_bytes_per_replica(weights: tuple[torch.Tensor, ...]) -> int:
    return sum(w[0].numel() * w.element_size() for w in weights)
