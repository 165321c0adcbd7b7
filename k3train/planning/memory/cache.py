"""What the memory estimate may reuse across layouts of one model config (the planner's speed-up)."""
from __future__ import annotations

from typing import Any, Callable

from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.planning.memory.fake_model import build_full
from moonep.shard import mark_expert_params


class EstimateCache:
    """What :func:`k3train.planning.memory.estimate.estimate` may reuse across layouts of ONE model config;
    ``store`` (a :class:`~k3train.planning.memory.store.MemoryStore`): its pieces and optimizer transients are
    the stored ones, kept across processes."""

    def __init__(self, store: Any = None) -> None:
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.store = store
        self.pieces: dict = store.pieces if store is not None else {}
        self.ns: dict = store.ns if store is not None else {}
        self.results: dict[Any, Any] = {}  # layout -> Estimate (a re-plan for another device traces nothing)
        self._full: dict[tuple, Any] = {}
        self.deadline: float | None = None  # estimate raises limits.TraceDeadline once time.perf_counter() passes it
        self.limit: float | None = None  # ... and limits.TraceTooBig once one chunk's micro-batches hold more

    def full_model(self, cfg: Any, ep: int, fake: Any) -> Any:
        key = (ep, cfg.train.dtype)
        if key not in self._full:
            m = build_full(cfg, ep, 0, fake)
            mark_expert_params(m)
            self._full[key] = m
        return self._full[key]

    def lazy_full(self, cfg: Any, ep: int) -> LazyModel:
        """:meth:`full_model` built on first use: a piece found in the cache needs no model (building K3's on fake
        tensors takes seconds per ep)."""
        return LazyModel(lambda: self.full_model(cfg, ep, self.fake), ep)


class LazyModel:
    """A model built when first used (any attribute but ``lazy_ep``, the expert-parallel size it is built for:
    :func:`~k3train.planning.memory.pieces.trace_piece` keys a piece's local experts by it)."""

    def __init__(self, build: Callable[[], Any], ep: int) -> None:
        self.lazy_ep = ep
        self._build = build

    def __getattr__(self, name: str) -> Any:
        return getattr(self._build(), name)
