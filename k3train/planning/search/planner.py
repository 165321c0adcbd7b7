"""The planner: the search's phases in order (see :mod:`k3train.planning.search`), and a layout's memory trace."""
from __future__ import annotations

import math
import time
from typing import Any

from k3train.config import ConfigError
from k3train.planning.memory.cache import EstimateCache
from k3train.planning.memory.estimate import estimate
from k3train.planning.memory.limits import TraceTooBig
from k3train.planning.programs import rank_programs, single_program
from k3train.planning.search.layouts import Layout, Validator, enumerate_layouts
from k3train.planning.search.notes import memory_bound_note, skip_notes
from k3train.planning.search.piece_bounds import PieceBounds
from k3train.planning.search.rank import Search
from k3train.planning.search.rows import PlanResult, Row
from k3train.planning.search.time_bound import compute_lower_bound
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.facts import ParamFacts


class Planner:
    def __init__(self, config: str, overrides: list[str], world: int, dev: Device, *, top: int = 10,
                 skew: float = 1.5, exhaustive: bool = False, layer_times: Any = None,
                 trace_budget_s: float = 240.0, sim_budget_s: float = 120.0, time_budget_s: float = math.inf,
                 log: Any = print,
                 pairs: tuple[list[tuple[Layout, Any]], int] | None = None,
                 cache: EstimateCache | None = None) -> None:
        self.config, self.overrides, self.world, self.dev = config, overrides, world, dev
        self.top, self.skew, self.exhaustive, self.lt = top, skew, exhaustive, layer_times
        self.trace_budget_s, self.sim_budget_s, self.log = trace_budget_s, sim_budget_s, log
        self.time_budget_s = time_budget_s  # the whole plan's seconds, enumeration included (``run``)
        self.cache = cache or EstimateCache()
        self._programs: dict[tuple, Any] = {}
        self._pairs = pairs
        self.enum_s = 0.0  # seconds the caller spent enumerating ``pairs``

    def programs(self, lay: Layout, M: int, paired: bool) -> list[list[Any]]:
        """The F/B programs of ``lay`` (``paired``: built from F/B pairing's schedule; paired by the caller)."""
        if lay.pp == 1:
            return [single_program(M)]
        key = (lay.schedule, lay.pp, lay.vpp, M, paired)
        if key not in self._programs:
            self._programs[key] = rank_programs(lay.schedule, lay.pp, lay.vpp, M, paired)
        return self._programs[key]

    def run(self) -> PlanResult:
        t0 = time.perf_counter()
        pairs, checked = self._pairs or enumerate_layouts(self.config, self.overrides, self.world)
        t_enum = time.perf_counter() - t0 if self._pairs is None else self.enum_s
        # the plan's wall-clock end: simulation and traces stop there whatever their own budgets have left
        t_end = t0 + self.time_budget_s - (self.enum_s if self._pairs is not None else 0.0)
        if not pairs:
            raise ConfigError(f"no valid layout of {self.config} for world size {self.world} "
                              f"(with the dimensions pinned on the command line)")
        base = pairs[0][1]
        self.log(f"{len(pairs)} valid layouts ({checked} candidates checked) in {t_enum:.1f} s")
        facts = ParamFacts.build(base)
        val = Validator(base, self.world)
        opt_times = self.lt.optimizer_in_trainer(base, facts.infos) if self.lt is not None else None
        rows = [Row(layout=lay, cfg=cfg) for lay, cfg in pairs]
        notes: list[str] = []
        t1 = time.perf_counter()
        ep_ends = (min(r.layout.ep for r in rows), max(r.layout.ep for r in rows))  # what the FFN bound is traced at
        bounds = PieceBounds(self.cache, facts, val, self.dev.hbm_bytes, t_end, ep_ends)
        n_bound = self._memory_bounds(rows, bounds, notes)
        live = [r for r in rows if not r.skipped]
        for r in live:
            r.lower_bound_s = compute_lower_bound(r.cfg, r.layout, val.partition(r.cfg), self.dev, facts, self.lt,
                                                  self.skew, opt_times)
        live.sort(key=lambda r: (r.lower_bound_s, r.layout))
        t_lb = time.perf_counter() - t1
        self.log(f"bounds: {n_bound} over the memory bound; step-time lower bounds of {len(live)}; {t_lb:.1f} s")
        search = Search(self, live, bounds, facts, val, opt_times, t_end)
        search.run()
        if (line := bounds.mixer_line()) is not None:
            self.log(line)
        if self.lt is not None:
            self.lt.save()
        notes += skip_notes(rows, self, search.n_mixer, search.n_late)
        secs = {"enumerate": t_enum, "bounds": t_lb, "simulate": search.t_sim, "memory": search.t_mem,
                "total": time.perf_counter() - t0 + (self.enum_s if self._pairs is not None else 0.0)}
        notes.append(f"memory traced for {search.n_traced} layouts in {search.t_mem:.1f} s; {len(rows)} layouts, "
                     f"{sum(r.pred is not None for r in rows)} simulated in {search.t_sim:.1f} s")
        return PlanResult(rows=rows, world=self.world, device=self.dev, base_cfg=base, candidates=checked,
                          seconds=secs, notes=notes)

    def _memory_bounds(self, rows: list[Row], bounds: PieceBounds, notes: list[str]) -> int:
        """Every row's static memory bound; how many are over the device (noted)."""
        for r in rows:
            bounds.static(r)
        n_bound = sum(r.skipped == "bound" for r in rows)
        if n_bound:
            notes.append(memory_bound_note(n_bound, self.dev.hbm_bytes))
        if (line := bounds.ffn_line()) is not None:
            self.log(line)
        return n_bound

    def trace(self, r: Row) -> None:
        """``r``'s memory (its estimate, kept in the cache: a re-plan for another device traces nothing): its worst
        rank's peak, per stage, and whether it fits; a trace stopped once a chunk is over the device gives a lower
        bound (``peak_is_bound``)."""
        if r.layout not in self.cache.results:
            self.cache.limit = self.dev.hbm_bytes  # a chunk (+ the weights) over it: too big, no further traces
            try:
                self.cache.results[r.layout] = estimate(r.cfg, self.world, self.cache)
            except TraceTooBig as e:
                r.peak_bytes, r.stage_peaks, r.fits, r.peak_is_bound = e.nbytes, [], False, True
                return
            finally:
                self.cache.limit = None
        est = self.cache.results[r.layout]
        r.peak_bytes = max(x.peak for x in est.ranks)
        r.stage_peaks = [max(x.peak for x in est.ranks if x.pp_rank == p) for p in range(r.layout.pp)]
        r.fits = r.peak_bytes <= self.dev.hbm_bytes
