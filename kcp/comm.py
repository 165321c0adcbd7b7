"""Collective helpers shared by the KCP pieces, plus a per-context byte counter.

Every collective here runs over one CP process group (``dims.group('cp')``): the ranks that hold the contiguous
segments of the same rows. ``group=None`` means a CP size of 1 and every helper degenerates to a local copy, so
the same code paths run in a single process.

Byte accounting ("moved per rank", what a ring algorithm puts on each rank's link): an all-gather of a local
buffer of ``b`` bytes moves ``(cp-1) * b``; a reduce-scatter of a full buffer of ``b`` bytes moves
``(cp-1)/cp * b``; a point-to-point send moves ``b``.

Hang safety (every rank of the group joins the same collectives in the same order whatever its data): the
autograd pieces here (:func:`all_gather_autograd`, :func:`tie`) let each KCP op make its exchange's backward run
on every rank whenever the op's output is used; every decision to communicate is taken from facts all CP ranks
share (the gathered layout, the shapes), never from local data.

F/B pairing (``parallel.overlap_ep``): ``group`` may be a :class:`parallel.pairing.SidedGroup`; every collective
here resolves it to the issuing thread's side when it runs (:func:`pg`), so a micro-batch's backward exchanges
use side 0's CP group even when its forward (and its context) ran on side 1.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.pairing import resolve_group as pg


class CommStats:
    """Bytes moved per rank, by kind (``kda_fwd``, ``kda_bwd``, ``mla_fwd``, ...), collective call counts, and
    wall seconds of the timed sections (``kda_fold_fwd`` / ``kda_fold_bwd``: gather + fold; ``kda_pairs_fwd``)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - t0

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.seconds.clear()

    def as_dict(self) -> dict[str, int]:
        return dict(self.bytes)


def group_size_rank(group: Any) -> tuple[int, int]:
    """``(size, rank within group)``; ``(1, 0)`` for ``None``."""
    group = pg(group)
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather_stacked(x: torch.Tensor, group: Any, stats: CommStats | None = None,
                       kind: str = "") -> torch.Tensor:
    """All-gather ``x`` (same shape on every rank) over ``group`` -> ``[cp, *x.shape]`` (rank order)."""
    size, _ = group_size_rank(group)
    if size == 1:
        return x.unsqueeze(0).clone()
    flat = x.contiguous().reshape(-1)
    out = x.new_empty(size * flat.numel())
    dist.all_gather_single(out, flat, group=pg(group))
    if stats is not None:
        stats.add(kind, (size - 1) * x.numel() * x.element_size())
    return out.view((size,) + tuple(x.shape))


def reduce_scatter_stacked(full: torch.Tensor, group: Any, stats: CommStats | None = None,
                           kind: str = "") -> torch.Tensor:
    """``full [cp, *shape]`` on every rank -> ``sum over ranks r' of full_{r'}[my rank]`` (``[*shape]``)."""
    size, _ = group_size_rank(group)
    if size == 1:
        return full[0].clone()
    if full.shape[0] != size:
        raise ValueError(f"reduce_scatter_stacked: leading dim {full.shape[0]} != group size {size}")
    # 1-D views: the collective splits the flat input into ``size`` equal pieces in rank order.
    flat = full.contiguous().reshape(-1)
    out = full.new_empty(full.shape[1:])
    dist.reduce_scatter_single(out.view(-1), flat, group=pg(group))
    if stats is not None:
        stats.add(kind, (size - 1) * out.numel() * out.element_size())
    return out


class _AllGatherStacked(torch.autograd.Function):
    """``x [*s] -> [cp, *s]`` (all-gather forward); backward: each rank's slot summed over ranks (reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, stats: CommStats | None, fwd_kind: str, bwd_kind: str) -> Tensor:
        ctx.group, ctx.stats, ctx.bwd_kind = group, stats, bwd_kind
        return all_gather_stacked(x, group, stats, fwd_kind)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return reduce_scatter_stacked(grad, ctx.group, ctx.stats, ctx.bwd_kind), None, None, None, None


def all_gather_autograd(x: Tensor, group: Any, stats: CommStats | None = None, fwd_kind: str = "",
                        bwd_kind: str = "") -> Tensor:
    """Differentiable :func:`all_gather_stacked`: ``[cp, *x.shape]`` forward, one reduce-scatter backward.

    The backward is a collective: the caller must make the result reach its op's output on EVERY rank (slice a
    part every rank uses, or :func:`tie` it in), or the ranks whose slice is empty would skip it and hang the rest.
    """
    return _AllGatherStacked.apply(x, group, stats, fwd_kind, bwd_kind)


class _Tie(torch.autograd.Function):
    """Identity on ``out``; the other inputs get zero gradients (see :func:`tie`)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, *deps: Tensor) -> Tensor:
        ctx.dep_meta = [(d.shape, d.dtype, d.device) for d in deps]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        zeros = tuple(torch.zeros(s, dtype=dt, device=dev) if ctx.needs_input_grad[i + 1] else None
                      for i, (s, dt, dev) in enumerate(ctx.dep_meta))
        return (grad,) + zeros


def tie(out: Tensor, *deps: Tensor) -> Tensor:
    """``out`` unchanged, made to depend on ``deps`` in the autograd graph.

    Why: the backward of an exchange node is a collective, and autograd runs a node only if the loss depends on
    its output. Whether an op's output *numerically* needs the exchanged tensor can depend on the local data (a
    segment that starts at a document start ignores the entry state), so KCP ties every exchange result into the
    op's returned tensor: whenever the op's output is used, the exchange's backward runs, on every rank alike.
    Tensors that do not require grad are skipped (no node, no cost).
    """
    deps = tuple(d for d in deps if d.requires_grad)
    if not deps or not torch.is_grad_enabled():
        return out
    return _Tie.apply(out, *deps)
