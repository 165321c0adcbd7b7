"""The planner: the search's phases in order (see :mod:`k3train.planning.search`), a layout's prediction and its
memory trace."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from k3train.config import ConfigError
from k3train.planning.memory.cache import EstimateCache
from k3train.planning.memory.estimate import estimate
from k3train.planning.memory.limits import TraceDeadline, TraceTooBig
from k3train.planning.memory.store import MemoryStore
from k3train.planning.programs import pairs_actions, rank_programs, single_program
from k3train.planning.search.layouts import Layout, Validator, layout_config
from k3train.planning.search.memory_bound import family_memory_lower_bound
from k3train.planning.search.memory_upper import MemoryUpper
from k3train.planning.search.notes import plan_notes
from k3train.planning.search.piece_bounds import PieceBounds
from k3train.planning.search.rank import Search, SearchHooks, SearchSettings
from k3train.planning.search.rows import PlanResult, Row
from k3train.planning.search.space import Core, Space, enumerate_space
from k3train.planning.search.time_bound import (compute_lower_bound, family_compute_bound,
                                                family_lower_bound)
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.facts import ParamFacts
from k3train.planning.step_time.predict import Prediction, predict
from parallel.pipeline.partition import build_partition

MATERIALIZED = 20000  # a space of at most this many layouts has a row for each up front (tables, JSON, --measure)


class Planner:
    def __init__(self, config: str, overrides: list[str], world: int, dev: Device, *, top: int = 10,
                 skew: float = 1.5, exhaustive: bool = False, complete: bool = False, layer_times: Any = None,
                 trace_budget_s: float = 240.0, sim_budget_s: float = 120.0, time_budget_s: float = math.inf,
                 log: Any = print, space: Space | None = None, cache: EstimateCache | None = None,
                 store: Path | bool | None = None, exact_memory: bool = False, progress_s: float = 10.0) -> None:
        self.config, self.overrides, self.world, self.dev = config, overrides, world, dev
        self.top, self.skew, self.exhaustive, self.complete, self.lt = top, skew, exhaustive, complete, layer_times
        self.trace_budget_s, self.sim_budget_s, self.log = trace_budget_s, sim_budget_s, log
        self.time_budget_s = time_budget_s  # the whole plan's seconds, enumeration included (``run``)
        self.cache, self.store_at, self.exact_memory, self.progress_s = cache, store, exact_memory, progress_s
        self.store: MemoryStore | None = None
        self._programs: dict[tuple, Any] = {}
        self._sims: dict[tuple, Any] = {}  # pipeline simulations shared by the layouts of other ZeRO stages
        self._dev_json: dict[str, Any] | None = None
        self._space = space
        self.enum_s = 0.0  # seconds the caller spent enumerating ``space``
        self.facts: ParamFacts | None = None
        self.val: Validator | None = None
        self.opt_times: dict[str, float] | None = None

    def programs(self, lay: Layout, M: int, paired: bool) -> list[list[Any]]:
        """The F/B programs of ``lay`` (``paired``: built from F/B pairing's schedule; paired by the caller)."""
        if lay.pp == 1:
            return [single_program(M)]
        key = (lay.schedule, lay.pp, lay.vpp, M, paired)
        if key not in self._programs:
            self._programs[key] = rank_programs(lay.schedule, lay.pp, lay.vpp, M, paired)
        return self._programs[key]

    def predict(self, r: Row, split_p2p: bool = False) -> Prediction:
        """``r``'s predicted step (:func:`~k3train.planning.step_time.predict.predict`); on a published device kept
        in the store, when the plan has one."""
        key = None
        if self.store is not None and not self.dev.is_cpu and not split_p2p:
            if self._dev_json is None:
                self._dev_json = asdict(self.dev)
            key = self.store.prediction_key(r.layout, self.world, self._dev_json, self.skew)
            if key in self.store.predictions:
                return Prediction(**self.store.predictions[key])
        programs = self.programs(r.layout, r.cfg.train.grad_accum_steps, pairs_actions(r.cfg))
        pred = predict(r.cfg, r.layout, self.val.partition(r.cfg), programs, self.dev, self.facts, self.lt,
                       self.skew, self.opt_times, split_p2p=split_p2p, sims=self._sims)
        if key is not None:
            self.store.predictions[key] = asdict(pred)
        return pred

    def run(self) -> PlanResult:
        t0 = time.perf_counter()
        space = self._space or enumerate_space(self.config, self.overrides, self.world)
        t_enum = time.perf_counter() - t0 if self._space is None else self.enum_s
        # the plan's wall-clock end: the search and its traces stop there whatever their own budgets have left
        t_end = t0 + self.time_budget_s - (self.enum_s if self._space is not None else 0.0)
        if not space.cores:
            raise ConfigError(f"no valid layout of {self.config} for world size {self.world} "
                              f"(with the dimensions pinned on the command line)")
        base = space.base
        self._setup(space)
        n = len(space)
        self.log(f"{n} valid layouts ({len(space.cores)} cores, {space.checked} candidates checked) in "
                 f"{t_enum:.1f} s")
        t1 = time.perf_counter()
        eps = [c.lay.ep for c in space.cores]
        bounds = PieceBounds(self.cache, self.facts, self.val, self.dev.hbm_bytes, t_end, (min(eps), max(eps)))
        hooks = _Hooks(self, space, bounds, n <= MATERIALIZED)
        search = Search(SearchSettings(top=self.top, hbm=self.dev.hbm_bytes, t_end=t_end,
                                       sim_budget_s=self.sim_budget_s, trace_budget_s=self.trace_budget_s,
                                       exhaustive=self.exhaustive, complete=self.complete,
                                       progress_s=self.progress_s), hooks.hooks(), bounds, hooks.families())
        t_bound = time.perf_counter() - t1
        status = search.run()
        rows = hooks.all_rows(search.c.rows, status)
        for line in (bounds.ffn_line(), bounds.mixer_line()):
            if line is not None:
                self.log(line)
        self._exact(rows, search)
        if self.lt is not None:
            self.lt.save()
        if self.store is not None:
            self.store.save()
        secs = {"enumerate": t_enum, "bounds": t_bound, "simulate": search.c.t_sim, "memory": search.c.t_mem,
                "total": time.perf_counter() - t0 + (self.enum_s if self._space is not None else 0.0)}
        return PlanResult(rows=rows, world=self.world, device=self.dev, base_cfg=base, candidates=space.checked,
                          seconds=secs, notes=plan_notes(rows, self, search.c, status), status=status, layouts=n)

    def _setup(self, space: Space) -> None:
        """What every phase reads: the parameters, the validation, the optimizer timings, the memory cache."""
        base = space.base
        self.facts = ParamFacts.build(base)
        self.val = Validator(base, self.world)
        self.opt_times = self.lt.optimizer_in_trainer(base, self.facts.infos) if self.lt is not None else None
        if self.store_at and self.store is None:
            self.store = MemoryStore(base, self.store_at if isinstance(self.store_at, Path) else None)
            if self.store.ignored:
                self.log(f"memory cache {self.store.path}: not used ({self.store.ignored}): traced again")
        if self.cache is None:
            self.cache = EstimateCache(self.store)

    def _exact(self, rows: list[Row], search: Search) -> None:
        """The chosen layout's exact peak (every ranked one's with ``exact_memory``) where its upper bound ranked
        it; within the trace budget (a layout it cannot trace is not ranked: ``skipped: 'trace budget'``)."""
        while True:
            ranked = sorted((r for r in rows if r.pred is not None and r.fits), key=lambda r: r.pred.step_s)
            todo = [r for r in (ranked if self.exact_memory else ranked[:1]) if r.peak_bytes is None]
            if not todo:
                return
            r = todo[0]
            left = self.trace_budget_s - search.c.t_mem
            ts = time.perf_counter()
            try:
                self.trace(r, None if left == math.inf else ts + max(0.0, left))
            except TraceDeadline:
                r.fits, r.skipped = None, "trace budget"
            search.c.t_mem += time.perf_counter() - ts

    def trace(self, r: Row, deadline: float | None = None) -> None:
        """``r``'s memory (its estimate, kept in the cache -- and the store, when the plan has one: a re-plan for
        another device traces nothing): its worst rank's peak, per stage, and whether it fits; a trace stopped once
        a chunk is over the device gives a lower bound (``peak_is_bound``). :class:`TraceDeadline` past
        ``deadline``."""
        key = self.store.estimate_key(r.layout, self.world) if self.store is not None else None
        if r.layout not in self.cache.results and key is not None and key in self.store.estimates:
            got = self.store.estimates[key]
            r.peak_bytes, r.stage_peaks = got["peak"], list(got["stage_peaks"])
            r.fits = r.peak_bytes <= self.dev.hbm_bytes
            return
        if r.layout not in self.cache.results:
            self.cache.limit = self.dev.hbm_bytes  # a chunk (+ the weights) over it: too big, no further traces
            self.cache.deadline = deadline
            try:
                self.cache.results[r.layout] = estimate(r.cfg, self.world, self.cache)
            except TraceTooBig as e:
                r.peak_bytes, r.stage_peaks, r.fits, r.peak_is_bound = e.nbytes, [], False, True
                return
            finally:
                self.cache.limit = self.cache.deadline = None
        est = self.cache.results[r.layout]
        r.peak_bytes = max(x.peak for x in est.ranks)
        r.stage_peaks = [max(x.peak for x in est.ranks if x.pp_rank == p) for p in range(r.layout.pp)]
        r.fits = r.peak_bytes <= self.dev.hbm_bytes
        if key is not None:
            self.store.estimates[key] = {"peak": r.peak_bytes, "stage_peaks": r.stage_peaks}
            self.store.save()


class _Hooks:
    """The planner's side of a :class:`Search` over ``space``: bounds, rows (every row made up front when
    ``materialized``), predictions, traces."""

    def __init__(self, p: Planner, space: Space, bounds: PieceBounds, materialized: bool) -> None:
        self.p, self.space, self.bounds, self.materialized = p, space, bounds, materialized
        self.made: dict[Layout, list[Row]] = {}
        self.upper = MemoryUpper(bounds)
        base = space.base
        self.whole = build_partition(base.model, replace(base.parallel, pp=1, vpp=1, pp_layers=[]),
                                     base.train.seq_len)
        if materialized:
            for core in space.cores:
                self.made[core.lay] = self._make(core)

    def hooks(self) -> SearchHooks:
        return SearchHooks(family_memory=self.family_memory, family_compute_bound=self.family_compute_bound,
                           family_bound=self.family_bound,
                           core_time=self.core_time, core_memory=self.core_memory, rows_of=self.rows_of,
                           count=self.space.count, row_bound=self.row_bound,
                           row_refined_bound=self.row_refined_bound, predict=self.p.predict,
                           trace=self.p.trace, upper=self.upper.of, log=self.p.log)

    def families(self) -> list[list[Core]]:
        """The cores by (pp, dp, cp, micro-batch, ep)."""
        fams: dict[tuple, list[Core]] = {}
        for c in self.space.cores:
            fams.setdefault((c.lay.pp, c.lay.dp, c.lay.cp, c.lay.mbs, c.lay.ep), []).append(c)
        return list(fams.values())

    def _knobs(self, core: Core, **want: Any) -> Layout:
        """``core``'s layout with each knob at the wanted value where the space has it, else at its first."""
        k = self.space.knobs
        vals = {"zero": k["zero"], "recompute": k["recompute"], "moonep": k["moonep"] if core.lay.ep > 1 else [False],
                "overlap_ep": k["overlap_ep"] if core.pairable else [False]}
        return replace(core.lay, **{n: (w if w in vals[n] else vals[n][0]) for n, w in want.items()})

    def _moonep(self, core: Core) -> set[bool]:
        return {False, True} & set(self.space.knobs["moonep"]) if core.lay.ep > 1 else {False}

    def family_memory(self, core: Core) -> int:
        """The static memory bound every layout of ``core``'s family is over (none when the rows are made up
        front: every row is bounded then)."""
        if self.materialized:
            return 0
        L = core.lay
        return family_memory_lower_bound(self.p.facts, core.cfg, L.pp, L.dp * L.cp, L.ep, max(self.space.knobs["zero"]))

    def family_compute_bound(self, core: Core) -> float:
        """The smallest :func:`family_compute_bound` over the MoonEP settings of ``core``'s family."""
        p = self.p
        return min(family_compute_bound(core.cfg, self._knobs(core, moonep=m), p.dev, p.lt, p.skew)
                   for m in self._moonep(core))

    def family_bound(self, core: Core) -> float:
        """The smallest :func:`family_lower_bound` over the MoonEP settings of ``core``'s family."""
        p = self.p
        return min(family_lower_bound(core.cfg, self._knobs(core, moonep=m), self.whole, p.dev, p.lt, p.skew)
                   for m in self._moonep(core))

    def core_time(self, core: Core) -> float:
        """The smallest step-time lower bound of ``core``'s layouts."""
        z = max(self.space.knobs["zero"])
        return min(self.row_bound(self._row(self._knobs(core, zero=z, moonep=m, recompute=False, overlap_ep=True),
                                            core)) for m in self._moonep(core))

    def core_memory(self, core: Core) -> int:
        """The memory bound of ``core``'s least memory-hungry layout (top ZeRO stage, recomputation, no MoonEP,
        unpaired): its static bound refined with the token mixers' pieces where they are traced already (in this
        plan or the store), as the search refines a row's when it comes up -- so that a core none of whose layouts
        fits is left out whole, before any of its rows is made or bounded in time (0 when the rows are made up
        front: every row is bounded then)."""
        if self.materialized:
            return 0
        z = max(self.space.knobs["zero"])
        least = self._row(self._knobs(core, zero=z, moonep=False, recompute=True, overlap_ep=False), core)
        self.bounds.static(least)
        if least.mem_bound <= self.bounds.hbm:  # a new cp's mixer trace takes seconds: left to its rows
            self.bounds.with_mixers(least, trace=False)
            least.mem_bound = max(least.mem_bound, self.bounds.bound[least.bound_key])
        return least.mem_bound

    def _row(self, lay: Layout, core: Core) -> Row:
        return Row(layout=lay, cfg=layout_config(core.cfg, lay))

    def _make(self, core: Core) -> list[Row]:
        rows = [self._row(lay, core) for lay in self.space.layouts(core)]
        for r in rows:
            self.bounds.static(r)
        return rows

    def rows_of(self, core: Core) -> list[Row]:
        return self.made[core.lay] if self.materialized else self._make(core)

    def row_bound(self, r: Row, exact_pairs: bool = False) -> float:
        p = self.p
        return compute_lower_bound(r.cfg, r.layout, p.val.partition(r.cfg), p.dev, p.facts, p.lt, p.skew,
                                   p.opt_times, exact_pairs)

    def row_refined_bound(self, r: Row) -> float:
        return self.row_bound(r, exact_pairs=True)

    def all_rows(self, examined: list[Row], status: Any) -> list[Row]:
        """The plan's rows: every row when made up front (those of cores the search left unexpanded marked with
        why), else the examined ones."""
        if not self.materialized:
            return examined
        out = [r for c in self.space.cores for r in self.made[c.lay]]
        for r in out:
            if r.pred is None and r.fits is None and not r.skipped:
                r.skipped = status.stopped_by or "slower"
        return out
