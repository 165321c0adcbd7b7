"""The ranking: branch and bound over predicted step time, tracing the memory of the contenders.

Best first: a row enters a queue at its step-time lower bound; when it reaches the front it is simulated and
re-enters at its prediction (every bound is at most its prediction), so rows are TRACED in predicted order -- a row
is traced only when no row not yet traced can be predicted faster -- and the trace budget goes to the fastest
layouts first (in lower-bound order, a layout bounded low but predicted slow took a trace of minutes before faster
ones). Once ``top`` layouts that FIT are known, a row whose bound (or prediction) is not below the ``top``-th of them
cannot enter the ranking (``skipped: 'slower'``); a recompute layout whose twin without recomputation fits is
dominated. Neighbours of traced layouts are examined next, ahead of the queue: a fitting layout's other vpp /
schedule variants, a too-big one's descent (:mod:`k3train.planning.search.descend`).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque
from typing import TYPE_CHECKING

from k3train.planning.memory.limits import TraceDeadline
from k3train.planning.programs import pairs_actions
from k3train.planning.search.descend import family_key, sibling_key, too_big_follow_ups, without_recompute
from k3train.planning.search.layouts import Layout, Validator
from k3train.planning.search.piece_bounds import PieceBounds
from k3train.planning.search.report import gib
from k3train.planning.search.rows import Row
from k3train.planning.step_time.facts import ParamFacts
from k3train.planning.step_time.predict import predict

if TYPE_CHECKING:
    from k3train.planning.search.planner import Planner


class Search:
    """One plan's ranking phase over the rows left by the bounds (``live``, sorted by their step-time lower bound):
    the queue, the layouts examined (``seen``), the fitting predictions, and the seconds and counts it spent."""

    def __init__(self, planner: Planner, live: list[Row], bounds: PieceBounds, facts: ParamFacts, val: Validator,
                 opt_times: dict[str, float] | None, t_end: float) -> None:
        self.p, self.bounds, self.facts, self.val, self.opt_times, self.t_end = (planner, bounds, facts, val,
                                                                                  opt_times, t_end)
        self.fitting: list[float] = []
        self.fits_norc: set[Layout] = set()
        self.t_sim = self.t_mem = 0.0
        self.n_traced = self.n_late = self.n_mixer = 0
        self.by_layout = {r.layout: r for r in live}
        self.families: dict[tuple, list[Row]] = {}
        self.siblings: dict[tuple, list[Row]] = {}  # same dims and memory knobs, another vpp / schedule
        for r in live:
            self.families.setdefault(family_key(r.layout), []).append(r)
            self.siblings.setdefault(sibling_key(r.layout), []).append(r)
        self.seen: set[Layout] = set()
        self.urgent: deque[Row] = deque()  # neighbours of traced layouts (descend, siblings): next
        self.heap: list[tuple[float, int, Row]] = [(r.lower_bound_s, i, r) for i, r in enumerate(live)]  # sorted
        self.index = {r.layout: i for i, r in enumerate(live)}

    def run(self) -> None:
        while True:
            r, from_urgent = self.next_row()
            if r is None:
                break
            self.step(r, from_urgent)

    def next_row(self) -> tuple[Row | None, bool]:
        while self.urgent or self.heap:
            from_urgent = bool(self.urgent)
            r = self.urgent.popleft() if from_urgent else heapq.heappop(self.heap)[2]
            if r.layout not in self.seen:
                return r, from_urgent
        return None, False

    def step(self, r: Row, from_urgent: bool) -> None:
        """``r`` at the front: cut, bounded out, simulated (and back in the queue at its prediction), or traced."""
        top = self.p.top
        kth = sorted(self.fitting)[top - 1] if len(self.fitting) >= top else math.inf
        if self._cut(r, kth) or self._over_refined_bound(r):
            return
        if r.pred is None and not self._simulate(r, from_urgent):
            return
        self._trace_and_record(r, kth)

    def _cut(self, r: Row, kth: float) -> bool:
        """Branch and bound: no faster than the ``top``-th fitting layout, or dominated by its twin."""
        lay, exhaustive = r.layout, self.p.exhaustive
        if not exhaustive and (r.pred.step_s if r.pred is not None else r.lower_bound_s) >= kth:
            self.seen.add(lay)
            r.skipped = "slower"
            return True
        if not exhaustive and lay.recompute and without_recompute(lay) in self.fits_norc:
            self.seen.add(lay)
            r.skipped = "dominated"
            return True
        return False

    def _over_refined_bound(self, r: Row) -> bool:
        """The bound refined with the pieces traced so far (:class:`PieceBounds`) is over the device."""
        b, hbm = self.bounds, self.p.dev.hbm_bytes
        b.with_mixers(r)
        if r.pred is None and r.bound_key in b.refine:
            b.with_known_ends(r)
            if r.mem_bound > hbm:
                self._too_big_with_ends(r, "(not simulated)")
                return True
        if b.bound[r.bound_key] != r.mem_bound:
            r.mem_bound = b.bound[r.bound_key]
            if r.mem_bound > hbm:
                self.seen.add(r.layout)
                r.fits, r.skipped = False, "bound"
                self.n_mixer += 1
                return True
        return False

    def _simulate(self, r: Row, from_urgent: bool) -> bool:
        """Predict ``r``; whether it goes on to its trace now (else it re-enters the queue at its prediction, or
        a budget is spent)."""
        p, lay = self.p, r.layout
        if not p.exhaustive and self.t_sim > p.sim_budget_s:
            self.seen.add(lay)
            r.skipped = "simulation budget"
            return False
        if not p.exhaustive and time.perf_counter() > self.t_end:
            self.seen.add(lay)
            r.skipped = "time budget"
            return False
        ts = time.perf_counter()
        programs = p.programs(lay, r.cfg.train.grad_accum_steps, pairs_actions(r.cfg))
        r.pred = predict(r.cfg, lay, self.val.partition(r.cfg), programs, p.dev, self.facts, p.lt, p.skew,
                         self.opt_times)
        self.t_sim += time.perf_counter() - ts
        if not p.exhaustive and not from_urgent:  # re-enters at its prediction
            heapq.heappush(self.heap, (r.pred.step_s, self.index[lay], r))
            return False
        return True

    def _trace_and_record(self, r: Row, kth: float) -> None:
        p = self.p
        self.seen.add(r.layout)
        if not p.exhaustive and r.pred.step_s >= kth:
            r.skipped = "slower"
            return
        if not p.exhaustive and self.t_mem > p.trace_budget_s:
            r.skipped = "trace budget"
            return
        if not p.exhaustive and time.perf_counter() > self.t_end:
            r.skipped = "time budget"
            return
        if self._trace(r):
            self._record(r)

    def _trace(self, r: Row) -> bool:
        """``r``'s memory: the bound with the end pieces, then the estimate (:meth:`Planner.trace`); whether it was
        traced (not: over the bound, or the budget ended the trace)."""
        p = self.p
        ts = time.perf_counter()
        # the budget bounds the traces' time itself: one started near its end stops at it (a K3 trace can take
        # 45 s), and what it traced of the model stays cached
        p.cache.deadline = None if p.exhaustive else min(ts + p.trace_budget_s - self.t_mem, self.t_end)
        try:
            if r.bound_key in self.bounds.refine:
                self.bounds.with_traced_ends(r, p.cache.deadline)
            r.mem_bound = self.bounds.bound[r.bound_key]
            if r.mem_bound > p.dev.hbm_bytes:
                self.t_mem += time.perf_counter() - ts
                self._too_big_with_ends(r, f"[{time.perf_counter() - ts:.1f} s]")
                return False
            p.trace(r)
        except TraceDeadline:
            r.skipped = "time budget" if time.perf_counter() > self.t_end else "trace budget"
            self.t_mem += time.perf_counter() - ts
            return False
        finally:
            p.cache.deadline = None
        self.t_mem += time.perf_counter() - ts
        self.n_traced += 1
        p.log(f"  memory of {r.layout.short()}: {'>' if r.peak_is_bound else ''}{gib(r.peak_bytes)} GiB "
              f"({'fits' if r.fits else 'too big'}), "
              f"predicted {r.pred.step_s:.4g} s [{time.perf_counter() - ts:.1f} s]")
        return True

    def _record(self, r: Row) -> None:
        """A traced row: a fitting one counts for the cut and sends its siblings ahead; a too-big one descends."""
        lay, exhaustive = r.layout, self.p.exhaustive
        if r.fits:
            self.fitting.append(r.pred.step_s)
            if not lay.recompute:
                self.fits_norc.add(lay)
            if not exhaustive:  # its other vpp / schedules are likely to fit too: examined next
                self.urgent.extendleft(reversed([t for t in self.siblings[sibling_key(lay)]
                                                 if t.layout not in self.seen]))
        elif not exhaustive:
            too_big_follow_ups(r, self.by_layout, self.seen, self.urgent, self.families)

    def _too_big_with_ends(self, r: Row, note: str) -> None:
        """Over the device on the bound with the end pieces: the descent goes on."""
        self.seen.add(r.layout)
        r.fits, r.skipped = False, "bound"
        self.n_late += 1
        self.p.log(f"  memory of {r.layout.short()}: over its bound with the embedding and head pieces, "
                   f"{gib(r.mem_bound)} GiB {note}")
        if not self.p.exhaustive:
            too_big_follow_ups(r, self.by_layout, self.seen, self.urgent, self.families)

