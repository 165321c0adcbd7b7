"""Communication primitives of MoonEP: persistent buffers, a differentiable all-to-all, async handles.

Buffers. Token all-to-alls go through two persistent 2-D buffers per (dtype, width, device) -- ``send`` and
``recv`` -- allocated once at a worst-case capacity and reused by every layer and step (grow-only; a grow is
logged because it means the worst case was underestimated). Nothing autograd saves ever aliases them: the
dispatcher copies rows out (the permutation into compute order is that copy), so a later micro-batch may reuse
the buffers while earlier micro-batches still wait for their backward.

Capacity (rows of width ``l``; ``N`` tokens per rank, top-``k``, ``R`` EP ranks, ``n = E/R``):
- send: ``N*k`` -- every route is sent exactly once (to itself included);
- recv with MoonEP: ``N*k`` -- the planner makes every rank compute exactly ``cap = T/R = N*k`` routes (for
  equal ``N``; otherwise ``ceil(T/R)``, and the buffer grows once);
- recv without MoonEP: ``R*N*min(k, n)`` -- no dropping, and one token can hit at most ``min(k, n)`` experts of
  one rank; all of them may pick the same rank's experts.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class CommBuffers:
    """Grow-only persistent 2-D buffers keyed by ``(name, dtype, width, device)``; ``get`` returns a row view.

    ``grows`` counts reallocations of the token buffers (``send``/``recv``), which are reserved at their worst case
    and should never grow; any other name grows to the largest size seen. (The replica weights live in
    :class:`moonep.replica_pool.ReplicaPool`; the reduce-back receives into per-round buffers it frees.)"""

    SIZED_UP_FRONT = ("send", "recv")

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.grows = 0

    def reserve(self, name: str, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        key = (name, dtype, width, torch.device(device))
        buf = self._bufs.get(key)
        if buf is None or buf.shape[0] < rows:
            if buf is not None and name in self.SIZED_UP_FRONT:
                self.grows += 1
                logger.warning("moonep: %s buffer grows from %d to %d rows (width %d)", name, buf.shape[0], rows,
                               width, extra={"rank_specific": True})  # per rank: not dropped off rank 0
            self._bufs[key] = torch.empty(rows, width, dtype=dtype, device=device)

    def get(self, name: str, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.reserve(name, rows, width, dtype, device)
        return self._bufs[(name, dtype, width, torch.device(device))][:rows]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def token_buffer_rows(tokens: int, k: int, ep: int, experts_per_rank: int, moonep: bool) -> tuple[int, int]:
    """``(send_rows, recv_rows)`` worst-case capacities (module docstring)."""
    send = tokens * k
    recv = tokens * k if moonep else ep * tokens * min(k, experts_per_rank)
    return send, recv


def all_to_all_rows(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: Any, async_op: bool = False) -> Any:
    """``dist.all_to_all_single`` along dim 0 (works on gloo with CPU tensors and NCCL); a local copy when
    ``group`` is None."""
    if group is None:
        out.copy_(inp)
        return None
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all of rows: forward sends ``in_splits[r]`` rows to rank ``r``; backward is the
    reverse all-to-all of the gradient (splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        all_to_all_rows(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        all_to_all_rows(g, grad.contiguous(), in_splits, out_splits, ctx.group)
        return g, None, None, None


def all_to_all_autograd(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable all-to-all over ``group`` (collective: every rank calls it, also in backward).

    ``x[sum(in_splits), ...]`` -> ``[sum(out_splits), ...]``; rows ``in_splits[r]`` go to group rank ``r``,
    ``out_splits[r]`` arrive from it (source-major order)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def wait_all(handles: list[Any]) -> None:
    for h in handles:
        if h is not None:
            h.wait()


def p2p_batch(sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]],
              group: Any) -> list[Any]:
    """Start point-to-point transfers ``(tensor, global peer rank, tag)`` on ``group``; returns the handles.

    Tags are distinct per (slot, matrix) so several messages between one pair never cross."""
    if group is None or not (sends or recvs):
        return []
    ops = [dist.P2POp(dist.isend, t, peer, group=group, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group, tag=tag) for t, peer, tag in recvs]
    return list(dist.batch_isend_irecv(ops))


def all_gather_counts(counts: torch.Tensor, group: Any, world: int) -> tuple[torch.Tensor, Any]:
    """Start gathering ``counts[E]`` (int64) from every rank of ``group``: returns ``(out[R*E], handle)``."""
    out = counts.new_empty(world * counts.numel())
    if group is None:
        out.copy_(counts)
        return out, None
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return out, gather(out, counts.contiguous(), group=group, async_op=True)
