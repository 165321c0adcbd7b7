"""The replica pool: MoonEP's replica weights in two fixed banks shared by every MoE layer of a rank.

Why. A rank hosts at most ``n = E/R`` replicas per layer (planner guarantee). Keeping them from a layer's
forward until its backward costs ``3*n*l*f`` weights per MoE layer and in-flight micro-batch (about 0.9 GB per
layer at K3 scale), far beyond any accelerator at K3's depth and pipeline warm-up. Instead (as MoonEP does) the
replicas live in a fixed buffer that every layer refills in its forward, and a layer's backward fetches them
again from the owners (the parameters do not change between a forward and its backward). So MoonEP's extra
weight memory per rank is two banks of ``[n, l, f] x 3`` whatever the depth and the number of micro-batches in
flight.

Two banks, so the backward of one layer can use one while the replicas of the layer whose backward comes next
(the previous MoE layer of the same model chunk and micro-batch) travel into the other: :meth:`prefetch_ahead`
is called once the current layer's own replicas are in, and its transfer overlaps the current layer's backward.

Correctness never depends on that guess: a bank remembers whose replicas it holds (a key per dispatch) and
whether a transfer into it is still in flight. A backward that finds its key in a bank (prefetched ahead, or
never overwritten since its forward) uses it; otherwise it fetches now. Reusing a bank first waits for its
pending transfer (which every peer posted too, in the same order). Every decision depends only on the sequence
of pool calls, which is the same on every rank of the EP group (they run the same schedule), so the sender of
a replica (its owner) and its receiver always agree on whether a transfer happens -- the zero-replica rank
included: it takes part in the bookkeeping like every other rank.

Graph mode keeps the replica FFN's autograd graph from forward to backward; the graph's references to the
bank (the saved weights) are replaced by :func:`bank_saved_tensor_hooks` with a reference that resolves to
whatever bank holds this dispatch's replicas when the backward runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moonep.comm import wait_all
from moonep.layout import RankLayout
from moonep.prefetch import start_prefetch_into

NUM_BANKS = 2


@dataclass
class ReplicaJob:
    """What a dispatch needs to (re)fetch its replicas: its key, layout, the owner-side weights and the groups."""

    layout: RankLayout
    weights: tuple[torch.Tensor, ...]  # this rank's (w_gate, w_up, w_down) parameter data
    group: Any
    ranks: list[int]
    experts_per_rank: int
    key: object = field(default_factory=object)
    chunk: int = 0  # the model chunk and MoE-layer order of the dispatcher: prefetch-ahead links
    order: int = 0
    prev: "ReplicaJob | None" = None  # the MoE layer run just before in the same chunk and forward pass


@dataclass
class _Bank:
    tensors: tuple[torch.Tensor, ...]
    content: object | None = None  # key of the job whose replicas it holds (complete once `handles` are waited)
    handles: list = field(default_factory=list)
    reserved: bool = False  # filled ahead for a backward still to come
    in_use: bool = False  # the running backward computes with it
    last_use: int = 0


class ReplicaPool:
    """Two banks per replica shape (normally one shape per model). ``fetches`` counts transfers started,
    ``found`` the backwards whose replicas were already in a bank (kept since forward, or fetched ahead)."""

    def __init__(self) -> None:
        self._banks: dict[tuple, list[_Bank]] = {}
        self._tick = 0
        self.fetches = 0
        self.found = 0
        self.last_forward: ReplicaJob | None = None

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    def _banks_for(self, weights: tuple[torch.Tensor, ...], n: int) -> list[_Bank]:
        key = tuple((tuple(w.shape[1:]), w.dtype, w.device) for w in weights) + (n,)
        banks = self._banks.get(key)
        if banks is None:  # zeros: unused slots stay finite (the padded-bmm fallback multiplies them by zero)
            banks = [_Bank(tuple(w.new_zeros((n,) + tuple(w.shape[1:])) for w in weights))
                     for _ in range(NUM_BANKS)]
            self._banks[key] = banks
        return banks

    def _find(self, job: ReplicaJob) -> _Bank | None:
        for bank in self._banks_for(job.weights, job.experts_per_rank):
            if bank.content is job.key:
                return bank
        return None

    def _claim(self, job: ReplicaJob) -> _Bank:
        """A bank for ``job``: not the one in use; a free one before one reserved ahead (least recently used)."""
        banks = [b for b in self._banks_for(job.weights, job.experts_per_rank) if not b.in_use]
        bank = min(banks, key=lambda b: (b.reserved, b.last_use))
        wait_all(bank.handles)  # finish what is travelling into it (every peer posted it too)
        bank.handles, bank.reserved, bank.content = [], False, None
        return bank

    def _fill(self, job: ReplicaJob, bank: _Bank) -> None:
        self._tick += 1
        self.fetches += 1
        bank.content, bank.last_use = job.key, self._tick
        bank.handles = start_prefetch_into(bank.tensors, job.layout, job.weights, job.group, job.ranks,
                                           job.experts_per_rank)

    # ---- the three uses ---------------------------------------------------------------------------------------
    def fill_forward(self, job: ReplicaJob) -> tuple[tuple[torch.Tensor, ...], list[Any]]:
        """Start fetching ``job``'s replicas for its forward; returns ``(bank tensors, handles)``: the caller waits
        the handles before reading the bank."""
        bank = self._claim(job)
        self._fill(job, bank)
        handles, bank.handles = bank.handles, []  # the caller waits them (a work is waited once)
        return bank.tensors, handles

    def link(self, job: ReplicaJob) -> None:
        """Record ``job`` as the latest forward (call only for forwards whose backward will run); link it to the
        previous one when that was the MoE layer just before it in the same chunk."""
        last = self.last_forward
        if last is not None and last.chunk == job.chunk and last.order == job.order - 1:
            job.prev = last
        self.last_forward = job

    def acquire_backward(self, job: ReplicaJob) -> tuple[_Bank, list[Any]]:
        """The bank that holds (or will hold, once the returned handles are waited) ``job``'s replicas for its
        backward; marked in use until :meth:`release`."""
        bank = self._find(job)
        if bank is None:
            bank = self._claim(job)
            self._fill(job, bank)
        else:
            self.found += 1
        bank.in_use, bank.reserved = True, False
        handles, bank.handles = bank.handles, []
        return bank, handles

    def prefetch_ahead(self, job: ReplicaJob | None) -> None:
        """Start fetching the replicas of the backward expected next (``job``), into the bank not in use."""
        if job is None or self._find(job) is not None:
            return
        bank = self._claim(job)
        self._fill(job, bank)
        bank.reserved = True

    def release(self, bank: _Bank) -> None:
        self._tick += 1
        bank.in_use, bank.last_use = False, self._tick

    def drain(self) -> None:
        """Wait for every transfer in flight (e.g. before changing the parameters)."""
        for banks in self._banks.values():
            for b in banks:
                wait_all(b.handles)
                b.handles, b.reserved = [], False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for banks in self._banks.values() for b in banks for t in b.tensors)


# --------------------------------------------------------------------------------------------------------------
class BankRef:
    """Stands in, inside a saved autograd graph, for a tensor that aliases a replica bank."""

    __slots__ = ("matrix", "size", "stride", "offset")

    def __init__(self, matrix: int, t: torch.Tensor) -> None:
        self.matrix, self.size, self.stride, self.offset = matrix, t.size(), t.stride(), t.storage_offset()


class BankHolder:
    """The replica tensors a saved replica graph resolves to; set by the backward before it differentiates."""

    def __init__(self) -> None:
        self.tensors: tuple[torch.Tensor, ...] | None = None


def bank_saved_tensor_hooks(bank_tensors: tuple[torch.Tensor, ...], holder: BankHolder) -> Any:
    """``saved_tensors_hooks`` that keep no reference to ``bank_tensors``: a saved tensor aliasing one of them is
    stored as its geometry and rebuilt from ``holder.tensors`` (this dispatch's replicas, fetched again) at
    unpack time. Any other saved tensor is kept as is."""
    ptrs = [t.untyped_storage().data_ptr() for t in bank_tensors]

    def pack(t: torch.Tensor) -> Any:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        return BankRef(ptrs.index(ptr), t) if ptr in ptrs else t

    def unpack(obj: Any) -> torch.Tensor:
        if isinstance(obj, BankRef):
            if holder.tensors is None:
                raise RuntimeError("moonep: replica graph differentiated before its replicas were fetched again")
            return holder.tensors[obj.matrix].as_strided(obj.size, obj.stride, obj.offset)
        return obj

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


__all__ = ["ReplicaJob", "ReplicaPool", "BankRef", "BankHolder", "bank_saved_tensor_hooks", "NUM_BANKS"]
