"""The plan and this rank's layout of one EP dispatch with ONE device->host copy and no ``[R, R, E]`` array.

:func:`moonep.planner.plan_redundant_experts` + :func:`moonep.layout.build_rank_layout` stay the readable
reference (tests/moonep/test_fast_layout.py checks equality field by field); this module computes the same plan
and the same index tensors, and is what the dispatcher runs. At K3 scale (E=896, R=64) the reference spends
tens of milliseconds per layer and micro-batch in the ``[R_src, R_dst, E]`` token split, two stable sorts and
host-built index tensors; here:

- the one synchronisation is :func:`counts_to_host`: the all-gathered ``[R, E]`` counts (``R*E`` ints) come to
  the host once; everything the all-to-all needs on the host (split sizes, group sizes, replica lists) is derived
  from them there, so nothing else ever waits for the device;
- the sequential part of the plan (at most ``R - 1`` receiver moves on ``[R]`` balances, then per donor group a
  greedy over its ``n`` experts and its quotas) runs on Python lists of that size: it is inherently sequential
  (each move depends on the previous argmax), and on lists it costs microseconds where the same loop as device
  kernels would be over a thousand tiny launches;
- the token split is only evaluated where it is not trivial: an expert computed on its owner alone (every
  expert but the <= E replicated ones) sends all its entries there, so the interval overlaps are
  ``[R, replicated]`` and ``[R, hosted]`` arrays;
- the token-scale index tensors are built on the device WITHOUT sorting: the routes sorted by expert (computed
  before the plan, overlapped with the count all-gather) split into *segments* (expert, destination) that are
  contiguous there; each segment moves as a block to its place in the send buffer (``send_order`` is one
  ``repeat_interleave`` + one scatter), and the received ``(source, group)`` blocks move as blocks into compute
  order (``recv_perm`` is one ``repeat_interleave``). All small per-segment arrays travel to the device in one
  packed non-blocking copy.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from moonep.layout import RankLayout, WeightTransfer, reduce_round
from moonep.planner import Plan, _check, balanced_capacity, plan_static


def counts_to_host(gathered: torch.Tensor, num_ranks: int) -> np.ndarray:
    """THE host synchronisation of a dispatch: the all-gathered ``[R*E]`` counts as an ``[R, E]`` int64 array."""
    return gathered.view(num_ranks, -1).to(device="cpu", dtype=torch.int64).numpy()


def plan_with_takes(counts: Sequence[int] | np.ndarray, num_ranks: int,
                    moonep: bool) -> tuple[Plan, np.ndarray]:
    """The plan of :func:`moonep.planner.make_plan` (identical, field by field) and its moves as ``takes[M, 3]``
    rows ``(expert, receiving rank, entries)``: entries of a home-group expert computed on a foreign rank."""
    c = _check(counts, num_ranks)
    if not moonep:
        return plan_static(c, num_ranks), np.zeros((0, 3), dtype=np.int64)
    R, E = num_ranks, c.size
    n = E // R
    cap = balanced_capacity(int(c.sum()), R)
    b = (c.reshape(R, n).sum(1) - cap).tolist()
    home = [-1] * R
    quotas: list[list[tuple[int, int]]] = [[] for _ in range(R)]  # quotas[h]: (receiver u, entries)
    while True:  # receivers: as the reference, max()/index() pick the lowest index on ties
        top = max(b)
        if top <= 0:
            break
        h, low = b.index(top), min(b)
        u = b.index(low)
        quotas[h].append((u, -low))
        b[h] = top + low
        b[u] = 0
        home[u] = h
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
    alloc = np.zeros((E, R), dtype=np.int64)
    alloc[np.arange(E), np.arange(E) // n] = c
    alloc[t[:, 0], t[:, 1]] += t[:, 2]  # (expert, receiver) pairs are distinct
    np.subtract.at(alloc, (t[:, 0], t[:, 0] // n), t[:, 2])
    hosted: list[list[int]] = [[] for _ in range(R)]
    for e, u in zip(t[:, 0].tolist(), t[:, 1].tolist()):
        hosted[u].append(e)
    replicas = tuple(tuple(sorted(x)) for x in hosted)
    return Plan(E, R, c, cap, alloc, replicas, np.array(home, dtype=np.int64)), t


def _overlap(a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray) -> np.ndarray:
    return np.clip(np.minimum(a_hi, b_hi) - np.maximum(a_lo, b_lo), 0, None)


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    np.cumsum(x[:-1], out=out[1:])
    return out


def fast_rank_layout(plan: Plan, takes: np.ndarray, counts_by_src: np.ndarray, me: int,
                     by_expert: torch.Tensor) -> RankLayout:
    """:func:`moonep.layout.build_rank_layout`'s layout of rank ``me`` (identical tensors and lists), plus
    ``cross_rows`` for the metrics and the compute-group offsets already on the device; ``split`` is None.

    ``counts_by_src``: the host ``[R, E]`` counts (:func:`counts_to_host`); ``by_expert``: this rank's flat route
    indices sorted by expert, stable (:func:`moonep.layout.local_route_positions`). No host synchronisation.
    """
    R, E, n = plan.num_ranks, plan.num_experts, plan.experts_per_rank
    cbs = counts_by_src
    device = by_expert.device
    n_routes = by_expert.numel()
    owner = np.arange(E) // n
    rep = np.unique(takes[:, 0])  # experts computed on more than one rank
    is_rep = np.zeros(E, dtype=bool)
    is_rep[rep] = True
    a_hi = np.cumsum(plan.alloc[rep], 1)  # [m, R] destination intervals of the replicated experts
    a_lo = a_hi - plan.alloc[rep]
    p_hi = np.cumsum(cbs[:, rep], 0)  # [R, m] source intervals
    p_lo = p_hi - cbs[:, rep]
    # replica slot of (expert, host): keys expert * R + host, sorted
    slot_keys = np.array([e * R + d for d in range(R) for e in plan.replicas[d]], dtype=np.int64)
    slot_vals = np.array([s for d in range(R) for s in range(len(plan.replicas[d]))], dtype=np.int64)
    key_order = np.argsort(slot_keys)
    slot_keys, slot_vals = slot_keys[key_order], slot_vals[key_order]

    # ---- send side: segments (expert, destination) in expert-major order = the order of `by_expert`
    mine = cbs[me]
    plain = np.flatnonzero(~is_rep & (mine > 0))
    ov = _overlap(p_lo[me][:, None], p_hi[me][:, None], a_lo, a_hi)  # [m, R] my entries of e going to d
    ri, rd = np.nonzero(ov)
    seg_e = np.concatenate([plain, rep[ri]])
    seg_d = np.concatenate([owner[plain], rd])
    seg_n = np.concatenate([mine[plain], ov[ri, rd]])
    order = np.argsort(seg_e, kind="stable")
    seg_e, seg_d, seg_n = seg_e[order], seg_d[order], seg_n[order]
    seg_g = seg_e - seg_d * n  # own expert at d: its local index
    foreign = seg_d != owner[seg_e]
    if foreign.any():
        seg_g[foreign] = n + slot_vals[np.searchsorted(slot_keys, seg_e[foreign] * R + seg_d[foreign])]
    send_key_order = np.argsort(seg_d * (2 * n) + seg_g)  # (destination, group) pairs are distinct
    send_start = np.empty_like(seg_n)
    send_start[send_key_order] = _excl_cumsum(seg_n[send_key_order])
    send_delta = send_start - _excl_cumsum(seg_n)
    send_splits = np.bincount(seg_d, weights=seg_n, minlength=R).astype(np.int64)

    # ---- receive side: the experts this rank computes (own, then replica slots) by source
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

    # ---- metrics: entries that stay on their source rank
    local = int(cbs[owner[~is_rep], np.flatnonzero(~is_rep)].sum()) + int(_overlap(p_lo, p_hi, a_lo.T, a_hi.T).sum())
    cross = int(plan.counts.sum()) - local

    # ---- device: one packed copy, then block moves
    s, b = seg_n.size, blocks.size
    packed = torch.from_numpy(np.concatenate([seg_n, send_delta, blocks, recv_delta, offsets]).astype(np.int64))
    packed = packed.to(device, non_blocking=True)
    seg_n_t, send_delta_t = packed[:s], packed[s:2 * s]
    blocks_t, recv_delta_t = packed[2 * s:2 * s + b], packed[2 * s + b:2 * s + 2 * b]
    offsets_t = packed[2 * s + 2 * b:].to(torch.int32)
    pos = torch.arange(n_routes, device=device) + torch.repeat_interleave(send_delta_t, seg_n_t,
                                                                          output_size=n_routes)
    send_order = torch.empty_like(by_expert)
    send_order[pos] = by_expert
    rows = int(recv_splits.sum())
    recv_perm = torch.arange(rows, device=device) + torch.repeat_interleave(recv_delta_t, blocks_t, output_size=rows)

    recvs = [WeightTransfer(e, int(owner[e]), me, sl) for sl, e in enumerate(plan.replicas[me])]
    sends = [WeightTransfer(e, me, d, sl) for d in range(R) if plan.home[d] == me
             for sl, e in enumerate(plan.replicas[d])]
    return RankLayout(
        me=me, send_order=send_order, send_splits=send_splits.tolist(), recv_splits=recv_splits.tolist(),
        recv_perm=recv_perm, group_counts=group_counts.tolist(), own_rows=int(group_counts[:n].sum()),
        prefetch_sends=sends, prefetch_recvs=recvs, split=None, cross_rows=cross, offsets_device=offsets_t,
        reduce_round=reduce_round(plan, me))


__all__ = ["counts_to_host", "plan_with_takes", "fast_rank_layout"]
