"""Live tensor bytes through a piece of code: a ``TorchDispatchMode`` that books every storage an op creates.

Why a dispatch mode: on CPU torch has no allocator statistics (``torch.cuda.max_memory_allocated`` exists only on
GPU), and under ``FakeTensorMode`` nothing is allocated at all, yet both need the same answer -- the peak of bytes
held by live tensors. Every op's outputs pass through ``__torch_dispatch__``; each new storage is booked once
(keyed by its ``data_ptr`` for real tensors, by the storage object's identity for fake ones) and un-booked by a
``weakref`` callback when torch frees it (storages keep their Python object alive while the C++ storage lives).
The same class measures a real training step (``k3train.planning.calibration.measure_memory``) and the fake one the estimator
runs (``k3train.planning.memory``), so the two numbers count exactly the same thing: storage bytes, no allocator
rounding or fragmentation (on GPU add the caching allocator's slack on top).

Threads: a dispatch mode is active on the thread that entered it only (torch's mode stack is thread-local), so
work another thread runs -- F/B pairing's worker (parallel/pairing.py) -- is booked only inside
:meth:`on_this_thread`; the bookkeeping is locked (storages may be booked and freed from both threads).

``phase`` labels (set by the caller) record the live bytes at the overall peak and the peak reached inside each
phase, so a report can say *where* the peak happened (forward, backward, optimizer step).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode
from torch.utils._pytree import tree_leaves


def _storage_key(t: torch.Tensor, st: torch.UntypedStorage) -> Any:
    if isinstance(t, FakeTensor) or t.device.type == "meta":
        return ("i", id(st))  # no address: the storage object is unique while it lives
    ptr = st.data_ptr()
    return ("p", st.device.type, ptr) if ptr else ("i", id(st))


class LiveBytes(TorchDispatchMode):
    """Books storages created while the mode is active (plus any tensors passed to :meth:`track`).

    Attributes: ``live`` (bytes now), ``peak`` (max of ``live``), ``peak_phase`` (phase at the peak),
    ``phase_peak`` {phase: max live bytes seen in it}."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[Any, int] = {}
        self._refs: dict[Any, Any] = {}
        self.live = 0
        self.peak = 0
        self.phase = "init"
        self.peak_phase = "init"
        self.phase_peak: dict[str, int] = {}
        self._lock = threading.RLock()  # (re-entrant: a weakref callback may run while booking)

    @contextlib.contextmanager
    def on_this_thread(self) -> Iterator[None]:
        """Book what the calling thread (not the one that entered the mode) creates inside the block."""
        _push_mode(self)
        try:
            yield
        finally:
            _pop_mode()

    # bookkeeping ------------------------------------------------------------------------------------------
    def _book(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - e.g. sparse / nested tensors: no plain storage
            return
        with self._lock:
            self._book_storage(t, st)

    def _book_storage(self, t: torch.Tensor, st: torch.UntypedStorage) -> None:
        key = _storage_key(t, st)
        size = st.nbytes()
        old = self._sizes.get(key)
        if old is not None:
            if size > old:  # a resize_ grew it in place
                self.live += size - old
                self._sizes[key] = size
                self._note()
            return
        self._sizes[key] = size
        self.live += size
        try:
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._release(k))
        except TypeError:
            pass  # not weak-referenceable: counted as live until the mode ends
        self._note()

    def _release(self, key: Any) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            self._refs.pop(key, None)
            if size is not None:
                self.live -= size

    def _note(self) -> None:
        if self.live > self.phase_peak.get(self.phase, -1):
            self.phase_peak[self.phase] = self.live
        if self.live > self.peak:
            self.peak, self.peak_phase = self.live, self.phase

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Book tensors that exist already (parameters built before the mode started)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._book(t)

    def set_phase(self, name: str) -> None:
        self.phase = name
        self._note()

    def reset_peak(self) -> None:
        self.peak, self.phase_peak, self.peak_phase = self.live, {}, self.phase

    # dispatch ---------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._book(t)
        return out
