"""The plan and this rank's layout of one EP dispatch with ONE device->host copy and no ``[R, R, E]`` array.

:func:`moonep.planner.plan_redundant_experts` + :func:`moonep.layout.build_rank_layout` stay the readable
reference (tests/moonep/test_fast_layout.py checks equality field by field); this module computes the same plan
and the same index tensors, and is what the dispatcher runs. At K3 scale (E=896, R=64) the reference spends
tens of milliseconds per layer and micro-batch in the ``[R_src, R_dst, E]`` token split, two stable sorts and
host-built index tensors; here:

- the one synchronisation is :func:`counts_to_host`: the all-gathered ``[R, E]`` counts (``R*E`` ints) come to
  the host once; everything the all-to-all needs on the host (split sizes, group sizes, replica lists) is derived
  from them there, so nothing else ever waits for the device;
- the sequential part of the plan (at most ``R - 1`` receiver moves, each the largest surplus against the
  largest deficit, on two heaps of ``[R]`` balances; then per donor group a greedy over its ``n`` experts and its
  quotas) runs on Python heaps and lists of that size: it is inherently sequential
  (each move depends on the previous argmax), and on lists it costs microseconds where the same loop as device
  kernels would be over a thousand tiny launches;
- the token split is only evaluated where it is not trivial: an expert computed on its owner alone (every
  expert but the <= E replicated ones) sends all its entries there, so the interval overlaps are
  ``[R, replicated]`` and ``[R, hosted]`` arrays;
- the token-scale index tensors are built on the device WITHOUT sorting: the routes sorted by expert (computed
  before the plan, overlapped with the count all-gather) split into *segments* (expert, destination) that are
  contiguous there; each segment moves as a block to its place in the send buffer, and the received
  ``(source, group)`` blocks move as blocks into compute order. A block move's target index is a running sum
  (1 inside a block, a jump at each block's start): ``ones`` + one small ``index_copy_`` + an in-place
  ``cumsum_``, then one ``scatter_`` for ``send_order``. All small per-segment arrays travel to the device in one
  packed non-blocking copy;
- the send side needs no search: a segment's place is its destination's offset plus, for an own expert, the
  destination's earlier own experts, for a replica, the destination's own total plus its earlier slots (the
  plan returns its moves in (receiver, slot) order).
"""
from __future__ import annotations

import heapq
from typing import NamedTuple, Sequence

import numpy as np
import torch

from moonep.layout import RankLayout, WeightTransfer, reduce_round
from moonep.planner import Plan, check_counts, balanced_capacity, plan_static


def counts_to_host(gathered: torch.Tensor, num_ranks: int) -> np.ndarray:
    """THE host synchronisation of a dispatch: the all-gathered ``[R*E]`` counts as an ``[R, E]`` int64 array."""
    return gathered.view(num_ranks, -1).to(device="cpu", dtype=torch.int64).numpy()


def plan_with_takes(counts: Sequence[int] | np.ndarray, num_ranks: int,
                    moonep: bool) -> tuple[Plan, np.ndarray]:
    """The plan of :func:`moonep.planner.make_plan` (identical, field by field) and its moves as ``takes[M, 4]``
    rows ``(expert, receiving rank, entries, replica slot at the receiver)``: entries of a home-group expert
    computed on a foreign rank, ordered by (receiver, expert), i.e. by (receiver, slot)."""
    c = check_counts(counts, num_ranks)
    if not moonep:
        return plan_static(c, num_ranks), np.zeros((0, 4), dtype=np.int64)
    R, E = num_ranks, c.size
    n = E // R
    cap = balanced_capacity(int(c.sum()), R)
    bal = (c.reshape(R, n).sum(1) - cap).tolist()
    # receivers, as the reference's argmax/argmin loop: the largest surplus h covers the largest deficit u (lowest
    # index on ties, which the heaps' (value, index) order gives). Every balance that changes is the one just
    # popped, so the heaps never hold a stale entry; the balances sum to zero, so a surplus implies a deficit.
    surplus = [(-x, i) for i, x in enumerate(bal) if x > 0]
    deficit = [(x, i) for i, x in enumerate(bal) if x < 0]
    heapq.heapify(surplus)
    heapq.heapify(deficit)
    home = [-1] * R
    quotas: list[list[tuple[int, int]]] = [[] for _ in range(R)]  # quotas[h]: (receiver u, entries)
    while surplus:
        neg_top, h = heapq.heappop(surplus)
        low, u = heapq.heappop(deficit)
        quotas[h].append((u, -low))
        home[u] = h
        rest = low - neg_top
        if rest > 0:
            heapq.heappush(surplus, (-rest, h))
        elif rest < 0:
            heapq.heappush(deficit, (rest, h))
    takes: list[tuple[int, int, int]] = []
    for h in range(R):
        if not quotas[h]:
            continue
        us = sorted(quotas[h])  # argmax over quotas by receiver index: lowest receiver on ties
        recv = [u for u, _ in us]
        q = [x for _, x in us]
        rem = c[h * n:(h + 1) * n].tolist()
        while True:
            qm = max(q)
            if qm <= 0:
                break
            i = q.index(qm)
            rm = max(rem)
            j = rem.index(rm)
            take = min(qm, rm)
            if take <= 0:  # unreachable (feasibility argument of moonep/planner.py)
                raise AssertionError("planner: home group ran out of tokens")
            takes.append((h * n + j, recv[i], take))
            rem[j] -= take
            q[i] -= take
    t = np.array(takes, dtype=np.int64).reshape(-1, 3)
    t = t[np.lexsort((t[:, 0], t[:, 1]))]  # by (receiver, expert): slot order
    per_host = np.bincount(t[:, 1], minlength=R)
    ends = np.cumsum(per_host)
    slot = np.arange(t.shape[0]) - np.repeat(ends - per_host, per_host)
    alloc = np.zeros((E, R), dtype=np.int64)
    experts = np.arange(E)
    alloc[experts, experts // n] = c - np.bincount(t[:, 0], weights=t[:, 2], minlength=E).astype(np.int64)
    alloc[t[:, 0], t[:, 1]] = t[:, 2]  # (expert, receiver) pairs are distinct, and a receiver is never the owner
    es, bounds = t[:, 0].tolist(), [0, *ends.tolist()]
    replicas = tuple(tuple(es[bounds[d]:bounds[d + 1]]) for d in range(R))
    return (Plan(E, R, c, cap, alloc, replicas, np.array(home, dtype=np.int64)),
            np.concatenate([t, slot[:, None]], axis=1))


def _overlap(a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray) -> np.ndarray:
    return np.maximum(np.minimum(a_hi, b_hi) - np.maximum(a_lo, b_lo), 0)


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    np.cumsum(x[:-1], out=out[1:])
    return out


def _step_values(delta: np.ndarray) -> np.ndarray:
    """The running sum's increment at each block's first entry: ``1 + delta[b] - delta[b - 1]`` (``delta[-1] = 1``,
    so that the first entry is ``delta[0]``)."""
    prev = np.empty_like(delta)
    prev[:1] = 1
    prev[1:] = delta[:-1]
    return 1 + delta - prev


def _running(size: int, starts: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``[size]``: ``j + delta(block of j)`` from the blocks' first entries and :func:`_step_values`."""
    inc = torch.ones(size, dtype=torch.int64, device=starts.device)
    inc.index_copy_(0, starts, steps)
    return inc.cumsum_(0)


class _Intervals(NamedTuple):
    """The replicated experts (computed on more than one rank) and their token intervals: ``[m, R]`` destination
    intervals ``[a_lo, a_hi)`` (the plan's allocation) and ``[R, m]`` source intervals ``[p_lo, p_hi)`` (the
    counts); an entry goes from source s to destination d where the two meet."""

    rep: np.ndarray  # [m] the replicated experts
    rep_of: np.ndarray  # [E] expert -> its row among `rep` (where replicated)
    a_lo: np.ndarray
    a_hi: np.ndarray
    p_lo: np.ndarray
    p_hi: np.ndarray


def _intervals(plan: Plan, takes: np.ndarray, cbs: np.ndarray) -> _Intervals:
    is_rep = np.bincount(takes[:, 0], minlength=plan.num_experts) > 0  # experts computed on more than one rank
    rep = np.flatnonzero(is_rep)
    rep_of = np.cumsum(is_rep) - 1  # expert -> its row among `rep` (where is_rep)
    alloc_rep = plan.alloc[rep]
    a_hi = np.cumsum(alloc_rep, 1)  # [m, R] destination intervals of the replicated experts
    a_lo = a_hi - alloc_rep
    c_rep = cbs[:, rep]
    p_hi = np.cumsum(c_rep, 0)  # [R, m] source intervals
    p_lo = p_hi - c_rep
    return _Intervals(rep, rep_of, a_lo, a_hi, p_lo, p_hi)


def _send_segments(plan: Plan, takes: np.ndarray, cbs: np.ndarray, me: int,
                   iv: _Intervals) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The send side: ``(seg_n, send_delta, send_splits)``, the non-empty segments (expert, destination) in the
    order of ``by_expert`` with each one's block move into the send buffer, and the entries per destination.

    The send buffer is destination-major; at destination d, d's own experts (local order) and then its replica
    slots. My entries of an expert go to its owner (all of them unless replicated); those of a replicated expert
    split over its hosts where my source interval meets their destination intervals."""
    R, E, n = plan.num_ranks, plan.num_experts, plan.experts_per_rank
    owner = np.arange(E) // n
    t_e, t_d = takes[:, 0], takes[:, 1]
    rep = iv.rep
    mine = cbs[me]
    ov = _overlap(iv.p_lo[me][:, None], iv.p_hi[me][:, None], iv.a_lo, iv.a_hi)  # [m, R] my entries of e going to d
    own_n = mine.copy()
    own_n[rep] = ov[np.arange(rep.size), owner[rep]]
    foreign_n = ov[iv.rep_of[t_e], t_d]  # takes are in (receiver, slot) order: the send order within a receiver
    own_by_d = own_n.reshape(R, n)
    own_tot = own_by_d.sum(1)
    foreign_tot = np.bincount(t_d, weights=foreign_n, minlength=R).astype(np.int64)
    send_splits = own_tot + foreign_tot
    base = _excl_cumsum(send_splits)
    own_start = (base[:, None] + np.cumsum(own_by_d, 1) - own_by_d).reshape(-1)
    # rows are grouped by receiver: a row's foreign entries before it = all earlier rows' minus earlier receivers'
    foreign_start = base[t_d] + own_tot[t_d] + _excl_cumsum(foreign_n) - _excl_cumsum(foreign_tot)[t_d]
    # the same segments in the order of `by_expert`: expert-major, destination ascending; empty ones dropped
    key = np.concatenate([np.arange(E) * R + owner, t_e * R + t_d])
    seg_n = np.concatenate([own_n, foreign_n])
    seg_start = np.concatenate([own_start, foreign_start])
    order = np.argsort(key)
    seg_n, seg_start = seg_n[order], seg_start[order]
    keep = seg_n > 0
    seg_n, seg_start = seg_n[keep], seg_start[keep]
    send_delta = seg_start - _excl_cumsum(seg_n)
    return seg_n, send_delta, send_splits


def _receive_blocks(plan: Plan, cbs: np.ndarray, me: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The receive side, the experts this rank computes (own, then replica slots) by source: ``(blocks,
    recv_delta, recv_splits, group_counts, offsets)``, the received ``(source, group)`` blocks in compute order
    (group-major, source-minor) with each one's block move, the entries per source and per group, and the
    compute groups' end offsets (own experts, then replica slots)."""
    R, n = plan.num_ranks, plan.experts_per_rank
    hosted = np.concatenate([np.arange(me * n, (me + 1) * n), np.array(plan.replicas[me], dtype=np.int64)])
    ch = cbs[:, hosted]
    hi_src = np.cumsum(ch, 0)
    dst_hi = plan.alloc[hosted, :me + 1].sum(1)
    per_src_group = np.zeros((R, 2 * n), dtype=np.int64)
    dst_lo = dst_hi - plan.alloc[hosted, me]
    per_src_group[:, :hosted.size] = _overlap(hi_src - ch, hi_src, dst_lo[None], dst_hi[None])
    recv_splits = per_src_group.sum(1)
    group_counts = per_src_group.sum(0)
    blocks = per_src_group.T.reshape(-1)  # compute order: group-major, source-minor
    src_start = (_excl_cumsum(recv_splits)[:, None] + np.cumsum(per_src_group, 1) - per_src_group).T.reshape(-1)
    recv_delta = src_start - _excl_cumsum(blocks)
    offsets = np.concatenate([np.cumsum(group_counts[:n]), np.cumsum(group_counts[n:])])
    return blocks, recv_delta, recv_splits, group_counts, offsets


def _cross_rows(plan: Plan, cbs: np.ndarray, iv: _Intervals) -> int:
    """For the metrics: the entries that leave their source rank (all but those that stay)."""
    R, n = plan.num_ranks, plan.experts_per_rank
    stay = cbs.reshape(R, R, n)[np.arange(R), np.arange(R)].reshape(-1)  # [E]: owner's own entries
    local = int(stay.sum() - stay[iv.rep].sum()) + int(_overlap(iv.p_lo, iv.p_hi, iv.a_lo.T, iv.a_hi.T).sum())
    return int(plan.counts.sum()) - local


def _device_moves(seg_n: np.ndarray, send_delta: np.ndarray, blocks: np.ndarray, recv_delta: np.ndarray,
                  offsets: np.ndarray, rows: int, by_expert: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(send_order, recv_perm, offsets on the device)``: one packed copy, then block moves. A block move is a
    running sum: the target of entry j of a block is j + delta(block), so its increment is 1 inside a block and
    1 + delta(b) - delta(b - 1) at block b's first entry (blocks are non-empty). ones + one small scatter + cumsum
    is far cheaper than repeat_interleave + add on a CPU, and on a GPU it is three kernels either way."""
    nz = blocks > 0
    blocks, recv_delta = blocks[nz], recv_delta[nz]
    s, b = seg_n.size, blocks.size
    packed = torch.from_numpy(np.concatenate([_excl_cumsum(seg_n), _step_values(send_delta), _excl_cumsum(blocks),
                                              _step_values(recv_delta), offsets]).astype(np.int64))
    packed = packed.to(by_expert.device, non_blocking=True)
    send_order = torch.empty_like(by_expert).scatter_(0, _running(by_expert.numel(), packed[:s], packed[s:2 * s]),
                                                      by_expert)
    recv_perm = _running(rows, packed[2 * s:2 * s + b], packed[2 * s + b:2 * s + 2 * b])
    return send_order, recv_perm, packed[2 * s + 2 * b:].to(torch.int32)


def fast_rank_layout(plan: Plan, takes: np.ndarray, counts_by_src: np.ndarray, me: int,
                     by_expert: torch.Tensor) -> RankLayout:
    """:func:`moonep.layout.build_rank_layout`'s layout of rank ``me`` (identical tensors and lists), plus
    ``cross_rows`` for the metrics and the compute-group offsets already on the device; ``split`` is None.

    ``counts_by_src``: the host ``[R, E]`` counts (:func:`counts_to_host`); ``by_expert``: this rank's flat route
    indices sorted by expert, stable (:func:`moonep.layout.local_route_positions`). No host synchronisation.
    """
    R, n = plan.num_ranks, plan.experts_per_rank
    cbs = counts_by_src
    iv = _intervals(plan, takes, cbs)
    seg_n, send_delta, send_splits = _send_segments(plan, takes, cbs, me, iv)
    blocks, recv_delta, recv_splits, group_counts, offsets = _receive_blocks(plan, cbs, me)
    cross = _cross_rows(plan, cbs, iv)
    send_order, recv_perm, offsets_t = _device_moves(seg_n, send_delta, blocks, recv_delta, offsets,
                                                     int(recv_splits.sum()), by_expert)
    owner = np.arange(plan.num_experts) // n
    recvs = [WeightTransfer(e, int(owner[e]), me, sl) for sl, e in enumerate(plan.replicas[me])]
    homes = plan.home.tolist()
    sends = [WeightTransfer(e, me, d, sl) for d in range(R) if homes[d] == me for sl, e in enumerate(plan.replicas[d])]
    return RankLayout(
        me=me, send_order=send_order, send_splits=send_splits.tolist(), recv_splits=recv_splits.tolist(),
        recv_perm=recv_perm, group_counts=group_counts.tolist(), own_rows=int(group_counts[:n].sum()),
        prefetch_sends=sends, prefetch_recvs=recvs, split=None, cross_rows=cross, offsets_device=offsets_t,
        reduce_round=reduce_round(plan, me))


__all__ = ["counts_to_host", "plan_with_takes", "fast_rank_layout"]
