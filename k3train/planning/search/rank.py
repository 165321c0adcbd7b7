"""The ranking: best first over the whole layout space by step-time lower bounds, every skip a bound.

One priority queue holds, by a lower bound on the predicted step time of what they stand for, smallest first:

* a FAMILY of cores (same pp, dp, cp, micro-batch size, ep; left out whole where its average stage's weights and
  optimizer state are over the device, :func:`~.memory_bound.family_memory_lower_bound`), first at its compute alone
  (:func:`~.time_bound.family_compute_bound`), then with its communication (:func:`~.time_bound.family_lower_bound`):
  popped there, its cores enter at their own bounds -- or leave at once, all their layouts with them, when even their
  least memory-hungry layout (top ZeRO stage, recomputation, no MoonEP, unpaired) is over the static memory bound;
* a CORE (:class:`~.space.Core`): popped, its layouts enter as rows at their lower bounds
  (:func:`~.time_bound.compute_lower_bound`), those over their static memory bound left out;
* a ROW at its lower bound: popped, its memory bound is refined with its token mixers' traced pieces (over the
  device: left out), else it is simulated and re-enters at its prediction (every bound is at most it);
* a ROW at its prediction: popped, nothing left can be predicted faster, so its memory is decided -- the bound
  with the end pieces over the device: too big; the upper bound (:mod:`.memory_upper`) within it: fits, untraced;
  else its estimate -- and a fitting row is the next of the ranking.

The search ends when ``top`` rows fit: nothing left can beat them, the ranking is PROVEN within the model (the
step-time model and the memory estimator; skips by bounds only). A budget (time, simulation, traces) may end it
first: then the result says so, with the best layout so far and what was left that could still beat it. Outside
``complete`` mode (the reference search: no budget, no heuristic) two heuristics of the planner act, and are
counted against the proof: a recompute layout whose twin without recomputation fits is dominated (it only
affects the ranks after that twin), and a layout traced too big marks too big, untraced, the layouts of its family
that hold at least as much per rank (:func:`~.descend.too_big_follow_ups`, whose lighter neighbours are simulated
next). ``exhaustive`` simulates and traces every layout (small spaces: the tests' reference for the memory).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from k3train.planning.memory.limits import TraceDeadline
from k3train.planning.search.descend import family_key, too_big_follow_ups, without_recompute
from k3train.planning.search.layouts import Layout
from k3train.planning.search.piece_bounds import PieceBounds
from k3train.planning.search.report import gib
from k3train.planning.search.rows import Row, SearchStatus

FAMILY, CORE, ROW, PREDICTED = range(4)  # what a queue entry stands for


@dataclass
class SearchSettings:
    """What bounds a search: how many fitting rows it ranks, the device's bytes, its budgets (``t_end``: the
    ``time.perf_counter()`` it stops at), its mode and how often it says where it is (``progress_s``)."""
    top: int
    hbm: float
    t_end: float = math.inf
    sim_budget_s: float = math.inf
    trace_budget_s: float = math.inf
    exhaustive: bool = False
    complete: bool = False
    progress_s: float = 10.0


@dataclass
class SearchHooks:
    """What the search calls for the planner: a family's / core's bounds (time; the core's least memory),
    a core's rows (static memory bounds set), a row's time bound, its prediction, its estimate, its upper
    bound, and the log."""
    family_memory: Callable[[Any], int]
    family_compute_bound: Callable[[Any], float]
    family_bound: Callable[[Any], float]
    core_time: Callable[[Any], float]
    core_memory: Callable[[Any], int]
    rows_of: Callable[[Any], list[Row]]
    count: Callable[[Any], int]
    row_bound: Callable[[Row], float]
    row_refined_bound: Callable[[Row], float]
    predict: Callable[[Row], Any]
    trace: Callable[[Row, float | None], None]
    upper: Callable[[Row, float | None], int | None]
    log: Callable[..., None]


@dataclass
class Counts:
    """What a search did: seconds simulating and tracing, rows simulated / traced, dropped on each refined bound."""
    t_sim: float = 0.0
    t_mem: float = 0.0
    n_sim: int = 0
    n_traced: int = 0
    n_mixer: int = 0
    n_late: int = 0
    n_upper: int = 0
    dropped_cores: int = 0  # layouts left out with their core (its least memory-hungry layout over the bound)
    dropped_families: int = 0  # ... with their family (its average stage's weights and optimizer state over it)
    rows: list[Row] = field(default_factory=list)


class Search:
    """One plan's search over ``families`` (lists of cores) with ``bounds`` (module docstring)."""

    def __init__(self, s: SearchSettings, h: SearchHooks, bounds: PieceBounds, families: list[list[Any]]) -> None:
        self.s, self.h, self.bounds = s, h, bounds
        self.c = Counts()
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        for fam in families:  # at their compute alone first: their communication when they come up
            if h.family_memory(fam[0]) > s.hbm:
                self.c.dropped_families += sum(h.count(c) for c in fam)
            else:
                self._push(h.family_compute_bound(fam[0]), FAMILY, (fam, False))
        self.fitting: list[Row] = []
        self.fits_norc: set[Layout] = set()
        self.by_layout: dict[Layout, Row] = {}
        self.families: dict[tuple, list[Row]] = {}
        self.seen: set[Layout] = set()
        self.time_refined: set[Layout] = set()  # rows whose time bound has been refined (:meth:`_at_bound`)
        self.urgent: deque[Row] = deque()  # lighter neighbours of a layout traced too big: simulated next
        self.heuristic: list[Row] = []  # rows ruled out by a heuristic (module docstring)
        self.simulated: list[tuple[float, int, Row]] = []  # by prediction: the incumbent's candidates
        self.incumbents: list[Row] = []  # rows that fit, decided ahead of their turn (:meth:`_incumbent`)
        self.incumbent_ids: set[int] = set()
        self.status = SearchStatus()
        self.t0 = self.t_report = time.perf_counter()
        self.last_front: tuple[float, float] | None = None  # (when, the queue's front) at the last progress line

    def _push(self, key: float, tag: int, item: Any) -> None:
        heapq.heappush(self.heap, (key, self.seq, tag, item))
        self.seq += 1

    @property
    def budgeted(self) -> bool:
        return not (self.s.complete or self.s.exhaustive)

    def run(self) -> SearchStatus:
        while self.heap or self.urgent:
            if self.budgeted and time.perf_counter() > self.s.t_end:
                return self._stop("time budget")
            if self.budgeted and self.c.t_sim > self.s.sim_budget_s:
                return self._stop("simulation budget")
            if not self.s.exhaustive and len(self.fitting) >= self.s.top:
                break
            self._progress()
            if self._incumbent():
                continue
            if self.urgent:
                self._simulate_urgent(self.urgent.popleft())
                continue
            key, _, tag, item = heapq.heappop(self.heap)
            if tag == FAMILY:
                self._expand_family(key, *item)
            elif tag == CORE:
                self._expand_core(item)
            elif tag == PREDICTED and id(item) in self.incumbent_ids:  # decided ahead (it fits): its turn now
                self.seen.add(item.layout)
                self.fitting.append(item)
            elif item.layout not in self.seen:
                (self._at_bound if tag == ROW else self._at_prediction)(item)
        return self._stop("")

    def _incumbent(self) -> bool:
        """Past half the time budget with nothing fitting yet: the fastest simulated row whose memory is not
        decided is decided now, ahead of its turn (one per call), so that a budget that ends first still has an
        answer -- the best so far. A fitting one joins the ranking when its turn comes."""
        s = self.s
        if not self.budgeted or self.fitting or self.incumbents or s.t_end == math.inf:
            return False
        if time.perf_counter() < self.t0 + (s.t_end - self.t0) / 2:
            return False
        while self.simulated and (self.simulated[0][2].layout in self.seen or self.simulated[0][2].fits):
            heapq.heappop(self.simulated)
        if not self.simulated:
            return False
        r = heapq.heappop(self.simulated)[2]
        self._at_prediction(r, incumbent=True)
        return True

    def _expand_family(self, key: float, cores: list[Any], refined: bool) -> None:
        """A family at its compute bound: its cores whose least memory-hungry layout is over the memory bound
        leave (all their layouts with them), the rest re-enter as the family at its bound with communication; at
        that, each core enters at its own bound."""
        if not refined:
            fit = [c for c in cores if self.h.core_memory(c) <= self.s.hbm]
            self.c.dropped_cores += sum(self.h.count(c) for c in cores if c not in fit)
            if not fit:
                return
            fine = self.h.family_bound(fit[0])
            if fine > key:
                self._push(fine, FAMILY, (fit, True))
                return
            cores = fit
        for core in cores:
            self._push(self.h.core_time(core), CORE, core)

    def _expand_core(self, core: Any) -> None:
        for r in self.h.rows_of(core):
            self.c.rows.append(r)
            self.by_layout[r.layout] = r
            self.families.setdefault(family_key(r.layout), []).append(r)
            if r.skipped:  # over its static memory bound
                self.seen.add(r.layout)
                continue
            r.lower_bound_s = self.h.row_bound(r)
            self._push(r.lower_bound_s, ROW, r)

    def _at_bound(self, r: Row) -> None:
        """``r`` popped at its lower bound: dominated, over its refined memory bound, or simulated."""
        if self.budgeted and r.layout.recompute and without_recompute(r.layout) in self.fits_norc:
            self._decide(r, "dominated")  # its twin fits and ranks first: only the ranks after it depend on it
            return
        if r.layout not in self.time_refined:  # its paired stages' simulated pairs in the bound: a few ms
            self.time_refined.add(r.layout)
            fine = self.h.row_refined_bound(r)
            if fine > r.lower_bound_s:
                r.lower_bound_s = fine
                self._push(fine, ROW, r)
                return
        if self._over_refined_bound(r):
            return
        self._simulate(r)
        self._push(r.pred.step_s, PREDICTED, r)

    def _over_refined_bound(self, r: Row) -> bool:
        """The bound refined with the token mixers' pieces (and the end pieces traced so far) over the device."""
        b = self.bounds
        b.with_mixers(r)
        if r.bound_key in b.refine:
            b.with_known_ends(r)
        r.mem_bound = max(r.mem_bound, b.bound[r.bound_key])
        if r.mem_bound > self.s.hbm:
            self.c.n_mixer += 1
            r.fits = False
            self._decide(r, "bound")
            return True
        return False

    def _simulate(self, r: Row) -> None:
        ts = time.perf_counter()
        r.pred = self.h.predict(r)
        self.c.t_sim += time.perf_counter() - ts
        self.c.n_sim += 1
        heapq.heappush(self.simulated, (r.pred.step_s, self.seq, r))
        self.seq += 1

    def _simulate_urgent(self, r: Row) -> None:
        if r.layout in self.seen or r.pred is not None or self._over_refined_bound(r):
            return
        self._simulate(r)
        self._push(r.pred.step_s, PREDICTED, r)

    def _at_prediction(self, r: Row, incumbent: bool = False) -> None:
        """``r`` popped at its prediction (nothing left is faster): its memory decided, a fitting row ranked
        (``incumbent``: decided ahead of its turn, :meth:`_incumbent`; ranked when its turn comes)."""
        deadline = None if not self.budgeted else min(self.s.t_end, time.perf_counter() + max(
            0.0, self.s.trace_budget_s - self.c.t_mem))
        ts = time.perf_counter()
        try:
            fits = self._memory(r, deadline)
        except TraceDeadline:
            fits = None
            self._decide(r, "time budget" if time.perf_counter() > self.s.t_end else "trace budget")
        self.c.t_mem += time.perf_counter() - ts
        if fits and incumbent:
            self.incumbents.append(r)
            self.incumbent_ids.add(id(r))
        elif fits:
            self.seen.add(r.layout)
            self.fitting.append(r)
            if not r.layout.recompute:
                self.fits_norc.add(r.layout)
        elif fits is False and self.budgeted:
            marked_before = {x.layout for x in self.c.rows if x.skipped.startswith("needs more memory")}
            too_big_follow_ups(r, self.by_layout, self.seen, self.urgent, self.families)
            self.heuristic += [x for x in self.c.rows if x.skipped.startswith("needs more memory")
                               and x.layout not in marked_before]

    def _memory(self, r: Row, deadline: float | None) -> bool | None:
        """Whether ``r`` fits: its bound with the end pieces, its upper bound, else its estimate (None: a budget
        stopped it)."""
        if self.budgeted and self.c.t_mem > self.s.trace_budget_s:
            self._decide(r, "trace budget")
            return None
        ts = time.perf_counter()
        b = self.bounds
        if r.bound_key in b.refine:
            b.with_traced_ends(r, deadline)
        r.mem_bound = max(r.mem_bound, b.bound[r.bound_key])
        if r.mem_bound > self.s.hbm:
            self.c.n_late += 1
            r.fits = False
            self._decide(r, "bound")
            self.h.log(f"  memory of {r.layout.short()}: over its bound with the embedding and head pieces, "
                       f"{gib(r.mem_bound)} GiB [{time.perf_counter() - ts:.1f} s]")
            return False
        if not self.s.exhaustive:
            up = self.h.upper(r, deadline)
            if up is not None and up <= self.s.hbm:
                r.mem_upper, r.fits = up, True
                self.c.n_upper += 1
                return True
        self.h.trace(r, deadline)
        if not r.fits:
            self.seen.add(r.layout)
        self.c.n_traced += 1
        self.h.log(f"  memory of {r.layout.short()}: {'>' if r.peak_is_bound else ''}{gib(r.peak_bytes)} GiB "
                   f"({'fits' if r.fits else 'too big'}), predicted {r.pred.step_s:.4g} s "
                   f"[{time.perf_counter() - ts:.1f} s]")
        return r.fits

    def _decide(self, r: Row, why: str, heuristic: bool = False) -> None:
        self.seen.add(r.layout)
        r.skipped = why
        if heuristic:
            self.heuristic.append(r)

    def _progress(self) -> None:
        """Every ``progress_s``: the phase, what was done, the best so far, the lower bound of the rest, and the time
        left -- of the budget, and to the proof at the pace the lower bound has been rising."""
        now = time.perf_counter()
        if now - self.t_report < self.s.progress_s:
            return
        front = self.heap[0][0] if self.heap else math.inf
        fit = self.fitting + self.incumbents
        best = min(fit, key=lambda r: r.pred.step_s) if fit else None
        eta = ""
        last = self.last_front
        if best is not None and last is not None and front > last[1]:
            pace = (front - last[1]) / (now - last[0])
            eta = f", the proof in ~{max(0.0, best.pred.step_s - front) / pace:.0f} s at this pace"
        self.last_front = (now, front)
        self.t_report = now
        phase = {FAMILY: "bounding families", CORE: "bounding cores", ROW: "simulating",
                 PREDICTED: "deciding memory"}.get(self.heap[0][2] if self.heap else -1, "ending")
        left = (f"{self.s.t_end - now:.0f} s of the budget left" if self.budgeted and self.s.t_end < math.inf
                else "no budget")
        self.h.log(f"  [{now - self.t0:.0f} s] {phase}: {len(self.c.rows)} layouts bounded, {self.c.n_sim} "
                   f"simulated, {self.c.n_traced} traced; "
                   + (f"best so far {best.layout.short()} {best.pred.step_s:.4g} s" if best else "nothing fits yet")
                   + f"; lower bound of the rest {front:.4g} s; {left}{eta}")

    def _stop(self, why: str) -> SearchStatus:
        """The status, and every row still queued (or unexamined) marked with why it was not ranked."""
        fit = sorted(self.fitting + [r for r in self.incumbents if r.layout not in self.seen],
                     key=lambda r: r.pred.step_s)
        best = fit[0].pred.step_s if fit else math.inf
        kth = fit[self.s.top - 1].pred.step_s if len(fit) >= self.s.top else math.inf
        left, lowest = 0, None
        for key, _, tag, item in self.heap:
            if tag in (ROW, PREDICTED):
                if item.layout in self.seen or item.fits:
                    continue
                item.skipped = why or ("slower" if key >= kth else item.skipped)
            n = (sum(self.h.count(c) for c in item[0]) if tag == FAMILY else self.h.count(item) if tag == CORE
                 else 1)
            if key < best:
                left += n
                lowest = key if lowest is None else min(lowest, key)
        for r in self.urgent:
            if r.layout not in self.seen and not r.skipped:
                r.skipped = why or "slower"
        unresolved = [r for r in self.c.rows if r.skipped in ("trace budget", "time budget", "simulation budget")
                      and (r.pred.step_s if r.pred is not None else r.lower_bound_s) < best]
        heur = [r for r in self.heuristic if (r.pred.step_s if r.pred is not None else r.lower_bound_s) < best]
        left += len(unresolved)
        undecided = sorted((r for _, _, r in self.simulated if r.layout not in self.seen and not r.fits
                            and r.pred.step_s < best), key=lambda r: r.pred.step_s)
        cand = (f"{undecided[0].layout.short()} ({undecided[0].pred.step_s:.4g} s; its memory at least "
                f"{gib(undecided[0].mem_bound)} GiB, not traced)" if undecided and why else "")
        self.status = SearchStatus(done=not why, proven=left == 0 and not heur, stopped_by=why, left=left,
                                   lowest_left_s=lowest, heuristic=len(heur), candidate=cand)
        return self.status
