"""``KCPContext``: the per-micro-batch context-parallel object the model layers call through ``seq.cp``.

The model stays free of ``torch.distributed``: a KDA layer calls ``seq.cp.conv_halo`` and ``seq.cp.kda``, an MLA
layer calls ``seq.cp.gather_latent``, ``seq.cp.mla_queries`` and ``seq.cp.mla_outputs``; all communication
happens here, over the CP group of a :class:`parallel.dims.ParallelDims` (``dims.group('cp')``).

Construction is collective over the CP group (every CP rank must build the context for the same micro-batch):
one tiny all-gather of the local shape, then one all-gather of each rank's segment edge summary (``[B, 5]``
int64: first / last doc id, last document start, first position, a well-formed flag; :mod:`kcp.edges`) -- not of
every token's doc id and position. From those, every rank knows what it needs of every segment's document
layout: the fold plans, the halo's previous doc ids and the MLA key doc ids / positions need no further
communication (earlier segments' doc ids are exact for the document this segment opens with, the only one that
reaches back across the boundary, and -1 elsewhere). With the MLA causal balance (``mla_balance``, the default;
:mod:`kcp.mla_cp`) one more exchange: this rank's ``[B, T]`` doc ids with its balance partner's.

Hang safety: every collective below runs on every CP rank at the same point of the layer, whatever the local
data; the exchanges' backward collectives are tied into the op outputs (:func:`kcp.comm.tie`), and the halo of a
KDA layer is also tied into that layer's KDA output (``conv_halo`` then ``kda`` is the layer's call order), so a
layer whose output is used runs every one of its backward exchanges on every rank.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from kcp.comm import CommStats, all_gather_stacked, group_size_rank, tie
from kcp.edges import SegmentEdges, local_edges
from kcp.fold import FoldPlan, plan_fold
from kcp.halo import conv_halo, halo_doc_ids
from kcp.kda_cp import kcp_chunk_kda
from kcp.mla_cp import (balance_partner, balanced_key_doc_ids, exchange_with_partner, gather_latent_prefix,
                         swap_second_halves)
from kcp.pairs import KdaFn, LocalLayout

logger = logging.getLogger(__name__)


def cp_group_of(dims_or_group: Any) -> Any:
    """A ``ParallelDims`` (its ``'cp'`` group, sided under F/B pairing: ``ParallelDims.sided``), a process group,
    or None (CP size 1)."""
    if dims_or_group is not None and hasattr(dims_or_group, "group") and hasattr(dims_or_group, "cp_rank"):
        sided = getattr(dims_or_group, "sided", None)
        return sided("cp") if sided is not None else dims_or_group.group("cp")
    return dims_or_group


class KCPContext:
    """Context parallelism for one micro-batch on one CP rank.

    Args:
        dims_or_group: ``ParallelDims`` (uses ``dims.group('cp')``), a process group, or None (single rank).
        doc_ids: ``LongTensor[B, T]`` this rank's contiguous segment of every row (T equal on all CP ranks; ids
            shared by all ranks of a row, equal ids across a boundary = same document).
        positions: ``LongTensor[B, T]`` positions within the full row (default: ``cp_rank*T + 0..T-1``).
        kda_fn: override the chunked kernel ``chunk_kda`` (tests, other kernels).
        mla_balance: MLA queries balanced over the CP ranks by half-segment swaps (``parallel.mla_cp_balance``,
            :mod:`kcp.mla_cp`); False: every rank attends its own segment's queries over its causal prefix.
    Collective over the CP group.
    """

    def __init__(self, dims_or_group: Any, doc_ids: Tensor, positions: Tensor | None = None, *,
                 kda_fn: KdaFn | None = None, stats: CommStats | None = None, mla_balance: bool = True) -> None:
        if doc_ids.dim() != 2:
            raise ValueError(f"KCPContext: doc_ids must be [B, T], got {tuple(doc_ids.shape)}")
        self.group = cp_group_of(dims_or_group)
        self.size, self.rank = group_size_rank(self.group)
        self.stats = stats if stats is not None else CommStats()
        self.kda_fn = kda_fn
        doc_ids = doc_ids.long()
        B, T = doc_ids.shape
        if positions is None:
            positions = (self.rank * T + torch.arange(T, device=doc_ids.device)).expand(B, T)
        if positions.shape != doc_ids.shape:
            raise ValueError(f"KCPContext: positions {tuple(positions.shape)} != doc_ids {tuple(doc_ids.shape)}")
        shapes = all_gather_stacked(torch.tensor([B, T], device=doc_ids.device), self.group, self.stats, "layout")
        if not bool((shapes == shapes[0]).all()):
            raise ValueError(f"KCPContext: every CP rank must hold a [B, T] segment of the same shape, got "
                             f"{shapes.tolist()} (is the sequence length divisible by cp?)")
        positions = positions.long()
        gathered = all_gather_stacked(local_edges(doc_ids, positions), self.group, self.stats, "layout")
        self.edges = SegmentEdges.from_gathered(gathered.cpu(), T)  # raises on every rank alike
        self.B, self.T = B, T
        self.layout = LocalLayout.from_doc_ids(doc_ids)
        self.docs = self.edges.segment_docs()
        self.plan: FoldPlan = plan_fold(self.docs, self.rank)
        r = self.rank
        self._halos: list[Tensor] = []  # conv halos not yet tied into a KDA output (see the module docstring)
        self.seen_doc_ids = self.edges.seen_doc_ids(r, doc_ids)  # [r+1, B, T] segments 0..r as this rank sees them
        # MLA (kcp/mla_cp.py): the queries this rank computes and the key segments 0..n-1 they need
        self.mla_balance = bool(mla_balance) and self.size > 1
        self.partner = balance_partner(r, self.size) if self.mla_balance else r
        if self.mla_balance:
            partner_doc = exchange_with_partner(doc_ids, self.group, self.partner, self.stats, "layout")
            key_docs = balanced_key_doc_ids(self.edges, r, doc_ids, self.partner, partner_doc)
            h = T // 2
            partner_pos = self.edges.positions(self.partner, doc_ids.device)[self.partner]
            self.query_doc_ids = torch.cat([doc_ids[:, :h], partner_doc[:, h:]], dim=1)
            self.query_positions = torch.cat([positions[:, :h], partner_pos[:, h:]], dim=1)
        else:
            key_docs = self.seen_doc_ids
            self.query_doc_ids, self.query_positions = doc_ids, positions
        self.key_segments = key_docs.shape[0]
        n = self.key_segments
        self.key_doc_ids = key_docs.permute(1, 0, 2).reshape(B, n * T)
        self.key_positions = self.edges.positions(n - 1, doc_ids.device).permute(1, 0, 2).reshape(B, n * T)
        logger.debug("%r: chain rows fold=%s", self, self.plan.fwd_b.sum(0).tolist())

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_batch(cls, batch: Any, dims_or_group: Any, **kwargs: Any) -> "KCPContext":
        """From anything with ``doc_ids`` and ``positions`` ``[B, T]`` (a CP-sliced ``Batch`` or a ``SeqInfo``)."""
        return cls(dims_or_group, batch.doc_ids, batch.positions, **kwargs)

    # ------------------------------------------------------------------------------------------------------
    # the contract methods (k3train/model layers call these through seq.cp)
    def conv_halo(self, x: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """``x [B, T, C] -> (prev [B, n, C], prev_doc [B, n])``: the n positions of the row before this
        segment, from as many earlier CP ranks as needed (zeros and doc id -1 before the row start). All-gather
        forward, reduce-scatter backward over the CP group (see :mod:`kcp.halo`)."""
        self._check_bt(x, "conv_halo")
        if n < 0:
            raise ValueError(f"KCPContext.conv_halo: halo width n={n} must be >= 0")
        prev_doc = halo_doc_ids(self.seen_doc_ids, self.rank, n).to(x.device)
        prev, prev_doc = conv_halo(x, n, prev_doc, self.group, self.stats)
        if prev.requires_grad:
            self._halos.append(prev)
        return prev, prev_doc

    def kda(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
            seq: Any = None) -> Tensor:
        """KDA over this rank's segment with the state carried in from earlier ranks; ``o [B, T, H, V]``.

        q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``; ``seq`` (the layer's SeqInfo) is only
        checked for shape. One all-gather over the CP group forward and one backward (see :mod:`kcp.kda_cp`).
        """
        if seq is not None and tuple(seq.doc_ids.shape) != (self.B, self.T):
            raise ValueError(f"KCPContext.kda: seq is {tuple(seq.doc_ids.shape)}, context {(self.B, self.T)}")
        o, _ = self.kda_with_state(q, k, v, g, beta, scale=scale, output_final_state=False)
        return o

    def kda_with_state(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                       scale: float | None = None, output_final_state: bool = True) -> tuple[Tensor, Tensor | None]:
        """As :meth:`kda`, also returning each row's state after its last local token ``[B, H, K, V]``
        (on the last CP rank: the row's final state)."""
        self._check_bt(k, "kda")
        o, final = kcp_chunk_kda(q, k, v, g, beta, layout=self.layout, plan=self.plan, group=self.group,
                                 scale=scale, output_final_state=output_final_state, kda_fn=self.kda_fn,
                                 stats=self.stats)
        halos, self._halos = self._halos, []
        return tie(o, *halos), final

    def gather_latent(self, latent: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``latent [B, T, L] -> (latent_keys [B, nT, L], key_doc_ids, key_positions [B, nT])``.

        Keys are the segments of CP ranks ``0..n-1``: the causal prefix ``0..r``, or under the MLA balance
        ``0..max(r, partner)`` (the prefix of both query groups). All-gather forward, reduce-scatter backward,
        over the CP group.
        """
        self._check_bt(latent, "gather_latent")
        return gather_latent_prefix(latent, self.key_doc_ids.to(latent.device),
                                    self.key_positions.to(latent.device), self.group, self.stats,
                                    self.key_segments)

    def mla_queries(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The MLA layer input of the queries this rank computes: ``x [B, T, d] -> (x_q [B, T, d], q_doc_ids,
        q_positions [B, T])``. Under the balance: this rank's first half-segment and its partner's second
        (one all-to-all forward and one backward, every rank); else ``x`` and this segment's ids."""
        self._check_bt(x, "mla_queries")
        dev = x.device
        if self.mla_balance:
            x = swap_second_halves(x, self.group, self.partner, self.stats, "mla_swap_fwd", "mla_swap_bwd")
        return x, self.query_doc_ids.to(dev), self.query_positions.to(dev)

    def mla_outputs(self, y: Tensor) -> Tensor:
        """The MLA layer output of :meth:`mla_queries`' queries back to the ranks that own their positions
        (the same swap; identity without the balance)."""
        self._check_bt(y, "mla_outputs")
        if self.mla_balance:
            y = swap_second_halves(y, self.group, self.partner, self.stats, "mla_swap_fwd", "mla_swap_bwd")
        return y

    # ------------------------------------------------------------------------------------------------------
    def _check_bt(self, x: Tensor, what: str) -> None:
        if tuple(x.shape[:2]) != (self.B, self.T):
            raise ValueError(f"KCPContext.{what}: input is [B, T] = {tuple(x.shape[:2])}, the context was built "
                             f"for {(self.B, self.T)}")

    def __repr__(self) -> str:
        return (f"KCPContext(cp={self.size}, rank={self.rank}, B={self.B}, T={self.T}, chain={self.plan.any_chain}, "
                f"mla_balance={self.mla_balance})")
