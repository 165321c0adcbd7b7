"""When a trace stops early: the planner's time budget is spent, or one chunk alone is over the device."""
from __future__ import annotations

import time


class TraceDeadline(Exception):
    """Raised between traces once ``EstimateCache.deadline`` (a ``time.perf_counter()`` value) has passed: the
    planner's memory-trace budget is spent (the pieces traced so far stay cached, and are exact)."""


class TraceTooBig(Exception):
    """Raised by a composed trace once one chunk alone -- one micro-batch's peak, or the saved bytes of its
    micro-batches in flight at the rank's first backward -- holds more than ``EstimateCache.limit`` bytes (the
    planner's device memory): the layout cannot fit whatever the rest adds, and the pieces not traced yet (minutes
    at long context without recomputation) are not needed. ``nbytes``: that lower bound."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"one chunk's micro-batches hold at least {nbytes} bytes")
        self.nbytes = nbytes


def check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise TraceDeadline
