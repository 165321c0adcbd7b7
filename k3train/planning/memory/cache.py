"""What the memory estimate may reuse across layouts of one model config (the planner's speed-up)."""
from __future__ import annotations

from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.planning.memory.fake_model import build_full
from moonep.shard import mark_expert_params


class EstimateCache:
    """What :func:`k3train.planning.memory.estimate.estimate` may reuse across layouts of ONE model config."""

    def __init__(self) -> None:
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.pieces: dict = {}
        self.ns: dict = {}
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
