"""Per-rank index layout of one EP dispatch, derived from a :class:`~moonep.planner.Plan` (no communication).

Every rank builds the same plan from the all-gathered ``counts_by_src[R, E]``; this module turns it into the
index tensors THIS rank needs:

- source side: which entry (``token * k + slot``) goes to which rank, in which order (``send_order``), and the
  all-to-all ``send_splits``;
- destination side: ``recv_splits``, and the permutation ``recv_perm`` from the all-to-all's source-major order to
  the *compute order*: ``2n`` groups -- this rank's ``n`` own experts (local index order) then its ``n`` replica
  slots -- each group holding its expert's entries in global (source rank, local order) order;
- the weight-transfer schedule: which local experts this rank sends to which replica slot of which rank
  (prefetch), and which replica slots it receives (the reduce-back is the same schedule reversed).

The source side orders its entries for rank ``d`` by ``(group at d, local order)``, so what arrives from each
source is already grouped; the receiver only interleaves the sources (one stable sort by group id).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moonep.planner import Plan, split_tokens


@dataclass
class WeightTransfer:
    """One replica: expert ``expert`` (owned by rank index ``src``) copied into replica slot ``slot`` of ``dst``."""

    expert: int
    src: int
    dst: int
    slot: int


@dataclass
class RankLayout:
    """Index tensors of one rank for one dispatch (see module docstring). Ranks are EP-group indices."""

    me: int
    send_order: torch.Tensor  # [N*k] long: flat entry indices in send-buffer order
    send_splits: list[int]  # [R] rows sent to each rank
    recv_splits: list[int]  # [R] rows received from each rank
    recv_perm: torch.Tensor  # [rows] long: compute-order row i = received row recv_perm[i]
    group_counts: list[int]  # [2n] rows per compute group (own experts, then replica slots)
    own_rows: int  # rows of the own-expert groups (they come first)
    prefetch_sends: list[WeightTransfer]  # replicas of this rank's experts, hosted elsewhere
    prefetch_recvs: list[WeightTransfer]  # this rank's replica slots, in slot order
    split: np.ndarray | None  # [R_src, R_dst, E] the full token split (reference layout only)
    cross_rows: int | None = None  # dispatched rows whose source != destination (EP-group total; metrics)
    offsets_device: torch.Tensor | None = None  # [2n] int32: cumulative group ends, own half then replica half
    reduce_round: int = -1  # reduce-back round in which this rank sends its replica grads home (-1: no replicas)

    def __post_init__(self) -> None:
        if self.cross_rows is None and self.split is not None:
            self.cross_rows = int(self.split.sum() - np.trace(self.split.sum(2)))

    @property
    def recv_rows(self) -> int:
        return int(sum(self.recv_splits))

    def own_offsets(self, device: torch.device) -> torch.Tensor:
        n = len(self.group_counts) // 2
        if self.offsets_device is not None:
            return self.offsets_device[:n]
        return torch.tensor(np.cumsum(self.group_counts[:n]), dtype=torch.int32, device=device)

    def replica_offsets(self, device: torch.device) -> torch.Tensor:
        n = len(self.group_counts) // 2
        if self.offsets_device is not None:
            return self.offsets_device[n:]
        return torch.tensor(np.cumsum(self.group_counts[n:]), dtype=torch.int32, device=device)


def weight_transfers(plan: Plan) -> list[WeightTransfer]:
    """Every replica of the plan, ordered by (destination, slot)."""
    return [WeightTransfer(e, plan.owner(e), d, s)
            for d in range(plan.num_ranks) for s, e in enumerate(plan.replicas[d])]


def reduce_round(plan: Plan, me: int) -> int:
    """This rank's index among the hosts of its home group (ascending rank): its reduce-back round
    (:mod:`moonep.grad_reduce`); -1 when it hosts no replica."""
    h = int(plan.home[me])
    return -1 if h < 0 else int((plan.home[:me] == h).sum())


def local_route_positions(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """``(flat[N*k], counts[E], by_expert[N*k])``: the routes, this rank's per-expert counts, and the route indices
    sorted by expert (stable: local order kept within an expert). Needs no plan, so it overlaps the count
    all-gather."""
    flat = topk_idx.reshape(-1)
    if flat.is_cuda:  # bincount sizes its output from the max on the host: a synchronisation
        counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(
            0, flat, torch.ones_like(flat))
    else:
        counts = torch.bincount(flat, minlength=num_experts)
        if counts.numel() != num_experts:
            raise ValueError(f"moonep: expert index out of range for num_experts={num_experts}")
    return flat, counts, torch.argsort(flat, stable=True)


def build_rank_layout(plan: Plan, counts_by_src: np.ndarray, me: int, topk_idx: torch.Tensor,
                      local: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> RankLayout:
    """The layout of rank ``me`` (EP-group index) whose routes are ``topk_idx[N, k]`` (long, global expert ids).

    ``counts_by_src[s, e]`` must be the all-gathered per-source counts; row ``me`` must equal this rank's
    ``bincount(topk_idx)``. ``local``: :func:`local_route_positions` if already computed.
    """
    R, E, n = plan.num_ranks, plan.num_experts, plan.experts_per_rank
    device = topk_idx.device
    split = split_tokens(plan, counts_by_src)
    table = plan.slot_table()  # [R, E]

    # ---- source side: this rank's routes of expert e are consecutive in e's global order, so in expert-sorted
    #      order their destinations are split[me, 0, e] x rank 0, split[me, 1, e] x rank 1, ...
    flat, counts_local, by_expert = local if local is not None else local_route_positions(topk_idx, E)
    if counts_local.tolist() != counts_by_src[me].tolist():
        raise ValueError("moonep layout: this rank's counts differ from the gathered counts")
    num = flat.numel()
    mine = torch.as_tensor(split[me].T.reshape(-1), device=device)  # [E*R], expert-major
    dest_sorted = torch.repeat_interleave(torch.arange(R, device=device).repeat(E), mine, output_size=num)
    dest = torch.empty_like(flat)
    dest[by_expert] = dest_sorted
    group = torch.as_tensor(table, dtype=torch.long, device=device)[dest, flat]
    send_order = torch.argsort(dest * (2 * n) + group, stable=True)
    send_splits = split[me].sum(1).tolist()

    # ---- destination side: per (source, group) counts in the order the all-to-all delivers them
    group_of_expert = table[me]  # [E]
    hosted = np.flatnonzero(group_of_expert >= 0)
    per_src_group = np.zeros((R, 2 * n), dtype=np.int64)
    per_src_group[:, group_of_expert[hosted]] = split[:, me, hosted]
    recv_splits = per_src_group.sum(1).tolist()
    group_ids = torch.arange(2 * n, device=device).repeat(R)
    row_group = torch.repeat_interleave(group_ids, torch.as_tensor(per_src_group.reshape(-1), device=device))
    recv_perm = torch.argsort(row_group, stable=True)
    group_counts = per_src_group.sum(0).tolist()

    transfers = weight_transfers(plan)
    return RankLayout(reduce_round=reduce_round(plan, me), 
        me=me, send_order=send_order, send_splits=send_splits, recv_splits=recv_splits, recv_perm=recv_perm,
        group_counts=group_counts, own_rows=int(sum(group_counts[:n])),
        prefetch_sends=[t for t in transfers if t.src == me],
        prefetch_recvs=[t for t in transfers if t.dst == me], split=split)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
