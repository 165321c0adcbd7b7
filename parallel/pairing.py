"""F/B pairing: the forward of one micro-batch runs at the same time as the backward of another, on two threads
of one rank, so that one side's expert all-to-all waits while the other side computes (``parallel.overlap_ep``).

Sides. Every thread of a rank runs on one *side*: 0 (the main thread: every unpaired action and the paired
backward) or 1 (the pair worker: the paired forward). :func:`current_side` is thread-local; whatever communicates
inside a paired action picks its process group, buffers and replica pool by it (``moonep.EPSide``), so the two
sides' collectives never meet on one group: every group sees the calls of one thread, in that thread's program
order, the same on every rank of the group. Nothing the two sides share is written by both: the forward side
writes the forward-only statistics (router loads, MoonEP metrics, QK maxima), the backward side the gradients, in
the same order as without pairing -- so results are bit-identical to ``overlap_ep: false``.

Groups a module holds across actions (the CP group of a micro-batch's KCP context, whose forward and backward can
run on different sides) are :class:`SidedGroup` s, resolved to the calling thread's side at every collective.

What runs concurrently is never ordered by a barrier: each side waits only for its own peers (the same side on
the other ranks). gloo's collectives and torch's ops release the GIL, so the overlap is real on CPU too.

Failures. :meth:`PairExecutor.run` always waits for both sides, then raises :class:`PairedActionError` naming the
side(s) that failed; a side blocked on a peer that failed ends when that peer's process exits (its connections
close) or at the collective timeout (``parallel.collective_timeout_s``), as any collective does.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

_TLS = threading.local()


def current_side() -> int:
    """The side this thread runs on (0 unless set by :func:`use_side`)."""
    return getattr(_TLS, "side", 0)


@contextlib.contextmanager
def use_side(side: int) -> Iterator[None]:
    """Run the block on ``side`` (this thread only)."""
    before = current_side()
    _TLS.side = side
    try:
        yield
    finally:
        _TLS.side = before


class SidedGroup:
    """One process group per side over the same ranks (``ParallelDims.sided``): a collective issued through it
    runs on the group of the side of the thread that issues it (:func:`resolve_group`), whichever side built the
    object that holds it -- a micro-batch's KCP context is built by its forward (maybe side 1) and its backward
    exchanges run later on side 0. ``groups[k]``: side k's group."""

    def __init__(self, groups: tuple[Any, ...]) -> None:
        if len(groups) < 2 or any(g is None for g in groups):
            raise ValueError("SidedGroup needs a real process group for each side")
        self.groups = tuple(groups)

    def __repr__(self) -> str:
        return f"SidedGroup({len(self.groups)} sides)"


def resolve_group(group: Any) -> Any:
    """The process group a collective over ``group`` uses on this thread: a :class:`SidedGroup`'s group of
    :func:`current_side`, anything else (a process group, None, a simulated group) unchanged."""
    if isinstance(group, SidedGroup):
        k = current_side()
        if k >= len(group.groups):
            raise RuntimeError(f"a collective on pairing side {k}, but its group has {len(group.groups)} sides")
        return group.groups[k]
    return group


class PairedActionError(RuntimeError):
    """One side (or both) of a paired action raised; the message names them, the first failure is the cause."""


class PairExecutor:
    """A persistent worker thread of this rank that runs side 1 of each pair (module docstring).

    ``run(worker_fn, main_fn, worker_what, main_what)`` starts ``worker_fn()`` on the worker (side 1), runs
    ``main_fn()`` on the calling thread (side 0), waits for both and returns ``(worker result, main result)``;
    ``*_what`` describe the sides in an error (``"forward of micro-batch 3"``). ``rank`` is named in errors."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._todo: Callable[[], Any] | None = None
        self._result: tuple[Any, BaseException | None] = (None, None)
        self._go = threading.Event()
        self._done = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="k3train-pair-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        with use_side(1):
            while True:
                self._go.wait()
                self._go.clear()
                fn, self._todo = self._todo, None
                if fn is None:  # close()
                    self._done.set()
                    return
                try:
                    self._result = (fn(), None)
                except BaseException as e:  # noqa: BLE001 - handed to the main thread
                    self._result = (None, e)
                self._done.set()

    def run(self, worker_fn: Callable[[], Any], main_fn: Callable[[], Any], worker_what: str,
            main_what: str) -> tuple[Any, Any]:
        if self._closed:
            raise RuntimeError("PairExecutor.run after close()")
        if current_side() != 0:
            raise RuntimeError("PairExecutor.run must be called from side 0 (not from inside a pair)")
        self._done.clear()
        self._todo = worker_fn
        self._go.set()
        main_res, main_err = None, None
        try:
            main_res = main_fn()
        except BaseException as e:  # noqa: BLE001 - raised below, after the worker finished
            main_err = e
        self._done.wait()
        worker_res, worker_err = self._result
        self._result = (None, None)
        if worker_err is None and main_err is None:
            return worker_res, main_res
        failed = [(what, e) for what, e in ((worker_what, worker_err), (main_what, main_err)) if e is not None]
        other = main_what if worker_err is not None else worker_what
        msg = "; ".join(f"the {what} raised {type(e).__name__}: {e}" for what, e in failed)
        if len(failed) == 1:
            msg += f" (paired with the {other}, which completed)"
        cause = failed[0][1]
        if isinstance(cause, KeyboardInterrupt):
            raise cause
        raise PairedActionError(f"rank {self.rank}: parallel.overlap_ep paired action failed: {msg}") from cause

    def close(self) -> None:
        """Stop the worker thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._done.clear()
        self._todo = None
        self._go.set()
        self._done.wait(timeout=5.0)
