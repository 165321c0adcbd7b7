"""The parallel-layout planner: enumerate valid layouts, bound, predict, estimate memory, rank (``tools/plan.py``).

Order of work (cheapest first, every skip exact):

1. :func:`k3train.planning.layouts.enumerate_layouts` -- every layout the run validation accepts.
2. Static memory bound (:func:`step_time.static_memory_lower_bound`: weights + gradients + optimizer state, or
   weights + optimizer state + the hidden-state partial sums of each forward the schedule runs before a rank's
   first backward; with sublayer or no recomputation, each FFN counts its traced piece's bytes (of one row)
   instead, :func:`memory.ffn_saved_bytes`, traced once for every cp and ep (at the smallest and the largest
   ep, the smaller: ``Planner._ffn_saved``); over several stages each forward's
   received AttnRes payload) above the device memory: infeasible, no trace (``fits: false,
   skipped: 'bound'``). Refined lazily, the same bound, under sublayer recomputation: when a layout first comes
   up (3.), each token mixer counts its piece's bytes, :func:`memory.mixer_bytes`, traced per cp (a line in the
   cp above 16) only for the cps of layouts that come up, with the first backward's peak composed as the
   estimator composes it; when it comes up for a trace (4.), the embedding and head pieces,
   :func:`memory.end_bytes`, too.
3. Step-time lower bound (:func:`step_time.compute_lower_bound`) for the rest; best first: a layout enters a
   queue at its lower bound, is simulated (:func:`step_time.predict`) when it reaches the front and re-enters at
   its prediction, so layouts are traced (4.) in predicted order, each only when no layout not yet traced can be
   predicted faster -- branch and bound: once ``top`` layouts that FIT are known, a layout whose lower bound (or
   prediction) is not below the ``top``-th of them cannot enter the ranking and is not simulated / traced
   (``skipped: 'slower'``). A recompute layout is dominated by its twin without recomputation when that one fits
   (same everything, strictly more compute): skipped (``skipped: 'dominated'``).
4. Memory: :func:`k3train.planning.memory.estimate` (the real code on fake tensors) for each simulated layout that
   could enter the ranking, with an :class:`EstimateCache` shared by all (fake full model per ep, per-layer fits,
   optimizer transients) -- ``fits`` = worst rank's peak <= device memory. A layout traced too big sends its
   recompute twin to the front of the queue and marks too big without a trace every layout of its family that
   holds at least as much per rank (lower ZeRO, larger micro-batch, smaller cp or ep:
   ``skipped: 'needs more memory than a layout traced too big'``), and the search descends from it depth first
   (recompute twin, half the micro-batch, twice the ep, one ZeRO stage more, twice the cp) to the memory limit;
   a layout that fits sends its other vpp / schedule variants (same dims, same memory knobs) to the front.

``--exhaustive`` simulates and traces every layout (small spaces; the tests use it).
"""
from __future__ import annotations

import math
import time
import heapq
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from k3train.planning.devices import Device
from k3train.planning.layouts import Layout, Validator, enumerate_layouts
from k3train.planning.memory import TraceDeadline, end_bytes, mixer_bytes
from k3train.planning.step_time import (ParamFacts, Prediction, compute_lower_bound, pairs_actions, predict,
                                        single_program, static_memory_lower_bound, forwards_before_first_backward)


class EstimateCache:
    """What :func:`k3train.planning.memory.estimate` may reuse across layouts of ONE model config."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.pieces: dict = {}
        self.ns: dict = {}
        self.results: dict[Layout, Any] = {}  # layout -> Estimate (a re-plan for another device traces nothing)
        self._full: dict[tuple, Any] = {}
        self.deadline: float | None = None  # estimate raises memory.TraceDeadline once time.perf_counter() passes it
        self.limit: float | None = None  # ... and memory.TraceTooBig once one chunk's micro-batches hold more

    def full_model(self, cfg: Any, ep: int, fake: Any) -> Any:
        from k3train.planning.memory import build_full
        from moonep.shard import mark_expert_params

        key = (ep, cfg.train.dtype)
        if key not in self._full:
            m = build_full(cfg, ep, 0, fake)
            mark_expert_params(m)
            self._full[key] = m
        return self._full[key]


@dataclass
class Row:
    layout: Layout
    cfg: Any = field(repr=False, default=None)
    mem_bound: int = 0
    lower_bound_s: float = 0.0
    pred: Prediction | None = None
    peak_bytes: int | None = None
    stage_peaks: list[int] = field(default_factory=list)
    fits: bool | None = None
    skipped: str = ""
    measured: dict[str, float] = field(default_factory=dict)  # measure_step's phases (``--measure``)
    peak_is_bound: bool = False  # peak_bytes is a lower bound (the trace stopped once a chunk exceeded the device)
    bound_key: tuple = field(repr=False, default=())  # what its static memory bound reads (``Planner.run``)

    @property
    def measured_step_s(self) -> float | None:
        return self.measured.get("step_time_s")

    def tokens_per_s(self, cfg: Any) -> float | None:
        if self.pred is None:
            return None
        return cfg.train.global_batch_size * cfg.train.seq_len / self.pred.step_s

    def as_json(self, cfg: Any, world: int, peak_flops: float) -> dict[str, Any]:
        return {"layout": asdict(self.layout), "fits": self.fits, "peak_bytes": self.peak_bytes,
                "peak_is_lower_bound": self.peak_is_bound,
                "stage_peak_bytes": self.stage_peaks or None, "memory_lower_bound_bytes": self.mem_bound,
                "predicted_step_s": self.pred.step_s if self.pred else None,
                "predicted_tokens_per_s": self.tokens_per_s(cfg),
                "predicted_tokens_per_s_per_device": (self.tokens_per_s(cfg) or 0) / world if self.pred else None,
                "mfu": mfu(self, cfg, world, peak_flops) if self.pred else None,
                "breakdown": self.pred.breakdown() if self.pred else None,
                "breakdown_detail": self.pred.detail if self.pred else None, "skipped": self.skipped or None,
                "measured_step_s": self.measured_step_s, "measured_phases": self.measured or None}


@dataclass
class PlanResult:
    rows: list[Row]
    world: int
    device: Device
    base_cfg: Any
    candidates: int
    seconds: dict[str, float]
    notes: list[str]

    def ranked(self) -> list[Row]:
        ok = [r for r in self.rows if r.pred is not None and r.fits]
        return sorted(ok, key=lambda r: r.pred.step_s)


def mfu(row: Row, cfg: Any, world: int, peak_flops: float) -> float:
    """Model FLOPs/s (``k3train.model.flops``, as the trainer's MFU) over the devices' peak."""
    from k3train.model.flops import model_flops_per_token

    tps = row.tokens_per_s(cfg) or 0.0
    return model_flops_per_token(cfg.model, cfg.train.seq_len) * tps / (world * peak_flops)


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
        from parallel.pipeline.p2p import build_programs
        from parallel.pipeline.schedules import build_schedule

        if lay.pp == 1:
            return [single_program(M)]
        key = (lay.schedule, lay.pp, lay.vpp, M, paired)
        if key not in self._programs:
            self._programs[key] = build_programs(build_schedule(lay.schedule, lay.pp, lay.vpp, M, paired), lay.pp,
                                                 lay.vpp)
        return self._programs[key]

    def run(self) -> PlanResult:
        t0 = time.perf_counter()
        pairs, checked = self._pairs or enumerate_layouts(self.config, self.overrides, self.world)
        t_enum = time.perf_counter() - t0 if self._pairs is None else self.enum_s
        # the plan's wall-clock end: simulation and traces stop there whatever their own budgets have left
        t_end = t0 + self.time_budget_s - (self.enum_s if self._pairs is not None else 0.0)
        if not pairs:
            from k3train.config import ConfigError

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
        # 2. static memory bound
        bound_memo: dict[tuple, int] = {}  # the bound reads the partition, dp*cp, ep, zero, moonep, tokens, schedule
        flight_memo: dict[tuple, list[list[int]]] = {}
        ffn_memo: dict[tuple, dict[bool, int] | None] = {}  # (row tokens, recompute) -> memory.ffn_saved_bytes
        ep_ends = (min(r.layout.ep for r in rows), max(r.layout.ep for r in rows))  # what the FFN bound is traced at
        mixer_memo: dict[tuple, dict[str, tuple[int, int]] | None] = {}  # (row tokens, cp) -> memory.mixer_bytes
        ends_memo: dict[tuple, dict[str, tuple[int, int]] | None] = {}  # (row tokens, cp, ep) -> memory.end_bytes
        ends_low: dict[tuple, dict[str, tuple[int, int]] | None] = {}  # (row tokens, cp) -> at most any ep's
        mixer_refine: dict[tuple, tuple] = {}  # bound key -> what the bound with the token mixers' pieces reads
        refine: dict[tuple, tuple] = {}  # bound key -> what the bound with the end pieces reads
        for r in rows:
            part = val.partition(r.cfg)
            L = r.layout
            tokens = L.mbs * r.cfg.train.seq_len // L.cp
            rc = r.cfg.parallel.recompute_granularity if L.recompute else None
            n_mb = r.cfg.train.global_batch_size // (L.dp * L.mbs)
            paired = pairs_actions(r.cfg)
            kb = (id(part), L.pp, L.dp * L.cp, L.ep, L.zero, L.moonep, tokens, L.mbs, rc, L.schedule, n_mb, paired)
            if kb not in bound_memo:
                sk = (L.schedule, L.pp, L.vpp, n_mb, paired)
                if sk not in flight_memo:
                    flight_memo[sk] = forwards_before_first_backward(*sk)
                args = (facts, r.cfg, part, L.pp, L.dp * L.cp, L.ep, L.zero, L.moonep, tokens, rc, flight_memo[sk])
                bound_memo[kb] = static_memory_lower_bound(*args)
                if bound_memo[kb] <= self.dev.hbm_bytes and rc in (None, "sublayer"):
                    # within the bound on one hidden state per FFN: count the FFN's traced bytes (once per row
                    # length, every cp alike) -- of ONE row: a micro-batch of several holds at least what one of its
                    # rows holds (the pieces' traces at one row serve every micro-batch size); also where the
                    # estimator traces whole chunks (short rows): a whole trace holds every FFN's saved tensors.
                    # Under sublayer recomputation the token mixers' pieces (per cp) when the layout first comes up
                    # (below)
                    ffn = self._ffn_saved(r, ffn_memo, t_end, ep_ends)
                    if ffn is not None:
                        bound_memo[kb] = static_memory_lower_bound(*args, ffn_saved=ffn)
                        if rc == "sublayer":
                            mixer_refine[kb] = (args, ffn)
            r.bound_key = kb
            r.mem_bound = bound_memo[kb]
            if r.mem_bound > self.dev.hbm_bytes:
                r.fits, r.skipped = False, "bound"
        n_bound = sum(r.skipped == "bound" for r in rows)
        if n_bound:
            notes.append(f"{n_bound} layouts exceed {self.dev.hbm_bytes / 2**30:.1f} GiB on weights + gradients + "
                         f"optimizer state, or weights + optimizer state + the partial sums of each forward before "
                         f"the first backward (under sublayer recomputation: what each FFN sublayer's traced piece "
                         f"keeps), alone: dropped without a trace")
        if ffn_memo:
            self.log("FFN bytes kept per micro-batch row (traced once for every cp; GiB, dense / MoE): " + "; ".join(
                f"{b} x {t} tokens{', recompute' if rc else ''}: "
                + ("budget spent" if v is None else " / ".join(f"{v[k] / 2**30:.2f}" for k in sorted(v)))
                for (b, t, rc), v in sorted(ffn_memo.items())))
        live = [r for r in rows if not r.skipped]
        for r in live:
            r.lower_bound_s = compute_lower_bound(r.cfg, r.layout, val.partition(r.cfg), self.dev, facts, self.lt,
                                                  self.skew, opt_times)
        live.sort(key=lambda r: (r.lower_bound_s, r.layout))
        t_lb = time.perf_counter() - t1
        self.log(f"bounds: {n_bound} over the memory bound; step-time lower bounds of {len(live)}; {t_lb:.1f} s")
        # 3 + 4: branch and bound over predicted time, tracing memory of the contenders
        fitting: list[float] = []
        fits_norc: set[Layout] = set()
        t_sim = t_mem = 0.0
        n_traced = n_late = n_mixer = 0
        by_layout = {r.layout: r for r in live}
        families: dict[tuple, list[Row]] = {}
        siblings: dict[tuple, list[Row]] = {}  # same dims and memory knobs, another vpp / schedule
        for r in live:
            families.setdefault(_family(r.layout), []).append(r)
            siblings.setdefault(_sibling_key(r.layout), []).append(r)
        seen: set[Layout] = set()
        urgent: deque[Row] = deque()  # neighbours of traced layouts (``_too_big_follow_ups``, siblings): next
        # best first: a row enters at its step-time lower bound; when it reaches the front it is simulated and
        # re-enters at its prediction (every bound is at most its prediction), so rows are TRACED in predicted
        # order -- a row is traced only when no row not yet traced can be predicted faster -- and the trace budget
        # goes to the fastest layouts first (in lower-bound order, a layout bounded low but predicted slow took
        # a trace of minutes before faster ones)
        heap = [(r.lower_bound_s, i, r) for i, r in enumerate(live)]  # ``live`` is sorted: already a heap
        index = {r.layout: i for i, r in enumerate(live)}

        def bound_with_ends(r: Row, ends, final: bool = True) -> None:
            """The bound with the first and last stage's traced pieces: ``final`` with those at the layout's ep,
            else with :meth:`Planner._ends_low`'s (a bound too, kept where it is over the device)."""
            args, ffn, mix = refine[r.bound_key]
            b = static_memory_lower_bound(*args, ffn_saved=ffn, mixer=mix, ends=ends)
            if final or b > self.dev.hbm_bytes:
                refine.pop(r.bound_key)
                bound_memo[r.bound_key] = r.mem_bound = b

        def too_big_with_ends(r: Row, note: str) -> None:  # over the device on that bound: the descent goes on
            nonlocal n_late
            seen.add(r.layout)
            r.fits, r.skipped = False, "bound"
            n_late += 1
            self.log(f"  memory of {r.layout.short()}: over its bound with the embedding and head pieces, "
                     f"{_gib(r.mem_bound)} GiB {note}")
            if not self.exhaustive:
                self._too_big_follow_ups(r, by_layout, seen, urgent, families)

        def next_row() -> tuple[Row | None, bool]:
            while urgent or heap:
                from_urgent = bool(urgent)
                r = urgent.popleft() if from_urgent else heapq.heappop(heap)[2]
                if r.layout not in seen:
                    return r, from_urgent
            return None, False

        while True:
            r, from_urgent = next_row()
            if r is None:
                break
            kth = sorted(fitting)[self.top - 1] if len(fitting) >= self.top else math.inf
            lay = r.layout
            if not self.exhaustive and (r.pred.step_s if r.pred is not None else r.lower_bound_s) >= kth:
                seen.add(lay)
                r.skipped = "slower"
                continue
            if not self.exhaustive and lay.recompute and _twin(lay) in fits_norc:
                seen.add(lay)
                r.skipped = "dominated"
                continue
            if r.bound_key in mixer_refine:  # first up: the bound with the token mixers' traced pieces at its cp
                # (a line in the cp above 16), the first backward's chunk composed as the estimator composes it --
                # traced for the cps of the layouts that come up, not for every cp of the space
                args, ffn = mixer_refine.pop(r.bound_key)
                mix = self._per_cp(r, mixer_bytes, mixer_memo, t_end)
                if mix is not None:
                    bound_memo[r.bound_key] = static_memory_lower_bound(*args, ffn_saved=ffn, mixer=mix)
                    refine[r.bound_key] = (args, ffn, mix)  # the end pieces: when it is about to be traced
            if r.pred is None and r.bound_key in refine:
                # the end pieces at its cp traced already (at the space's end eps, or at its ep): the bound with
                # them before a simulation (a fitting layout's AFAB sibling at many micro-batches is far over it,
                # and simulating it costs seconds)
                T_row = r.cfg.train.seq_len // lay.cp
                for ends, final in ((ends_low.get((1, T_row, lay.cp)), False),
                                    (ends_memo.get((1, T_row, lay.cp, lay.ep)), True)):
                    if ends is not None and r.bound_key in refine:
                        bound_with_ends(r, ends, final)
                if r.mem_bound > self.dev.hbm_bytes:
                    too_big_with_ends(r, "(not simulated)")
                    continue
            if bound_memo[r.bound_key] != r.mem_bound:
                r.mem_bound = bound_memo[r.bound_key]
                if r.mem_bound > self.dev.hbm_bytes:
                    seen.add(lay)
                    r.fits, r.skipped = False, "bound"
                    n_mixer += 1
                    continue
            if r.pred is None:
                if not self.exhaustive and t_sim > self.sim_budget_s:
                    seen.add(lay)
                    r.skipped = "simulation budget"
                    continue
                if not self.exhaustive and time.perf_counter() > t_end:
                    seen.add(lay)
                    r.skipped = "time budget"
                    continue
                ts = time.perf_counter()
                programs = self.programs(lay, r.cfg.train.grad_accum_steps, pairs_actions(r.cfg))
                r.pred = predict(r.cfg, lay, val.partition(r.cfg), programs, self.dev, facts, self.lt, self.skew,
                                 opt_times)
                t_sim += time.perf_counter() - ts
                if not self.exhaustive and not from_urgent:  # re-enters at its prediction
                    heapq.heappush(heap, (r.pred.step_s, index[lay], r))
                    continue
            seen.add(lay)
            if not self.exhaustive and r.pred.step_s >= kth:
                r.skipped = "slower"
                continue
            if not self.exhaustive and t_mem > self.trace_budget_s:
                r.skipped = "trace budget"
                continue
            if not self.exhaustive and time.perf_counter() > t_end:
                r.skipped = "time budget"
                continue
            ts = time.perf_counter()
            # the budget bounds the traces' time itself: one started near its end stops at it (a K3 trace can take
            # 45 s), and what it traced of the model stays cached
            self.cache.deadline = None if self.exhaustive else min(ts + self.trace_budget_s - t_mem, t_end)
            try:
                if r.bound_key in refine:  # the end pieces traced at this cp (for the estimate anyway: the same
                    # cache entries): over the device, too big without the rest -- first with what they hold at
                    # the space's smallest and largest ep (traced once per cp for every ep), then at its own
                    low = self._ends_low(r, ends_low, ends_memo, self.cache.deadline, ep_ends)
                    if low is None:
                        raise TraceDeadline()
                    bound_with_ends(r, low, final=False)
                    if r.bound_key in refine:
                        ends = self._per_cp(r, end_bytes, ends_memo, self.cache.deadline, by_ep=True)
                        if ends is None:
                            raise TraceDeadline()
                        bound_with_ends(r, ends)
                r.mem_bound = bound_memo[r.bound_key]
                if r.mem_bound > self.dev.hbm_bytes:
                    t_mem += time.perf_counter() - ts
                    too_big_with_ends(r, f"[{time.perf_counter() - ts:.1f} s]")
                    continue
                self.trace(r)
            except TraceDeadline:
                r.skipped = "time budget" if time.perf_counter() > t_end else "trace budget"
                t_mem += time.perf_counter() - ts
                continue
            finally:
                self.cache.deadline = None
            t_mem += time.perf_counter() - ts
            n_traced += 1
            self.log(f"  memory of {lay.short()}: {'>' if r.peak_is_bound else ''}{_gib(r.peak_bytes)} GiB "
                     f"({'fits' if r.fits else 'too big'}), "
                     f"predicted {r.pred.step_s:.4g} s [{time.perf_counter() - ts:.1f} s]")
            if r.fits:
                fitting.append(r.pred.step_s)
                if not lay.recompute:
                    fits_norc.add(lay)
                if not self.exhaustive:  # its other vpp / schedules are likely to fit too: examined next
                    urgent.extendleft(reversed([t for t in siblings[_sibling_key(lay)] if t.layout not in seen]))
            elif not self.exhaustive:
                self._too_big_follow_ups(r, by_layout, seen, urgent, families)
        if mixer_memo:
            self.log("token-mixer bytes per micro-batch row (saved / backward peak, GiB; at the CP rank with the "
                     "most MLA keys): " + "; ".join(
                         f"{b} x {t} tokens, cp {cp}: "
                         + ("budget spent" if v is None else ", ".join(
                             f"{k} {v[k][0] / 2**30:.2f} / {v[k][1] / 2**30:.2f}" for k in sorted(v)))
                         for (b, t, cp), v in sorted(mixer_memo.items())))
        if self.lt is not None:
            self.lt.save()
        why = {
            "slower": "layouts not simulated/traced: their step-time lower bound (or prediction) is above the "
                      f"{self.top}th fitting layout's prediction",
            "dominated": "recompute layouts skipped: their twin without recompute fits and is faster",
            "needs more memory than a layout traced too big":
                "layouts not traced: a layout of the same pp / vpp / schedule / MoonEP, recompute no less, a ZeRO "
                "stage, cp and ep no lower and a micro-batch no larger (so no more memory per rank) was traced "
                "too big",
            "trace budget": f"layouts predicted but not traced: memory trace budget ({self.trace_budget_s:.0f} s) "
                            "spent",
            "simulation budget": "layouts with the largest step-time lower bounds not simulated: simulation "
                                 f"budget ({self.sim_budget_s:.0f} s) spent",
            "time budget": f"layouts not simulated or traced: the plan's time budget ({self.time_budget_s:.0f} s, "
                           "enumeration included) spent",
        }
        if n_mixer:
            notes.append(f"{n_mixer} layouts exceed {self.dev.hbm_bytes / 2**30:.1f} GiB on that bound with their "
                         f"token mixers' pieces (traced at a layout's cp when the first layout of that cp came up): "
                         f"dropped without a simulation")
        if n_late:
            notes.append(f"{n_late} layouts exceed {self.dev.hbm_bytes / 2**30:.1f} GiB on that bound with the first "
                         f"and last stages' pieces (the embedding, the LM head + MTP layer: traced at a layout's cp "
                         f"when it came up for a trace, as its estimate would): dropped without the rest")
        for reason, text in why.items():
            n = sum(r.skipped == reason for r in rows)
            if n:
                notes.append(f"{n} {text}")
        secs = {"enumerate": t_enum, "bounds": t_lb, "simulate": t_sim, "memory": t_mem,
                "total": time.perf_counter() - t0 + (self.enum_s if self._pairs is not None else 0.0)}
        notes.append(f"memory traced for {n_traced} layouts in {t_mem:.1f} s; {len(rows)} layouts, "
                     f"{sum(r.pred is not None for r in rows)} simulated in {t_sim:.1f} s")
        return PlanResult(rows=rows, world=self.world, device=self.dev, base_cfg=base, candidates=checked,
                          seconds=secs, notes=notes)

    def _ffn_saved(self, r: Row, memo: dict[tuple, dict[bool, int] | None], t_end: float,
                   ep_ends: tuple[int, int]) -> dict[bool, int] | None:
        """``memory.ffn_saved_bytes`` for one row of ``r``'s micro-batch (``seq_len / cp`` tokens) under
        its recompute setting, at most what it is at any ep of the space: the smaller of its values at the
        smallest and the largest ep (``ep_ends``). What a MoE FFN saves is a few bookkeeping bytes per local
        expert (fewer at a larger ep) plus bytes per route row that are the same at every ep > 1, so no ep between
        holds less (``tests/planning/test_memory_compose.py``); two traces instead of one per ep (each ep's fake
        model and traces cost seconds at K3 width). Traced into the :class:`EstimateCache` (where the estimator
        composes per piece under sublayer recomputation, the estimates reuse them; where it traces whole chunks they
        are a part of what each layer of the trace keeps); None once the plan's time is spent."""
        from k3train.planning.memory import ffn_saved_bytes

        B, T = 1, r.cfg.train.seq_len // r.layout.cp  # one row (see ``run``)
        key = (B, T, r.layout.recompute)
        if key not in memo:
            memo[key] = _smaller([self._traced(r, ffn_saved_bytes, B, T, t_end, ep) for ep in sorted(set(ep_ends))])
        return memo[key]

    def _ends_low(self, r: Row, memo: dict[tuple, Any], ends_memo: dict[tuple, Any], t_end: float,
                  ep_ends: tuple[int, int]) -> dict[str, tuple[int, int]] | None:
        """``memory.end_bytes`` at ``r``'s cp, at most what they are at any ep of the space: the smaller of their
        values at its smallest and largest ep (the head's MTP layer runs the local experts: its backward holds a
        weight gradient per local expert, fewer at a larger ep; see :meth:`_ffn_saved`) -- two traces per cp
        instead of one per ep, for the bound of every layout at that cp."""
        key = (1, r.cfg.train.seq_len // r.layout.cp, r.layout.cp)
        if key not in memo:
            from k3train.planning.memory import end_bytes

            low = _smaller([self._per_cp(r, end_bytes, ends_memo, t_end, by_ep=True, ep=e)
                            for e in sorted(set(ep_ends))])
            if low is None:
                return None  # budget spent: not kept (a later trace may have the time)
            memo[key] = low
        return memo[key]

    def _per_cp(self, r: Row, fn: Any, memo: dict[tuple, Any], t_end: float,
                by_ep: bool = False, ep: int | None = None) -> dict[str, tuple[int, int]] | None:
        """``fn`` (``memory.mixer_bytes`` or ``memory.end_bytes``) for one row of ``r``'s micro-batch at its cp
        (under sublayer recomputation; None where the estimator traces whole chunks, or once the plan's time is
        spent); ``by_ep``: also per ep (``ep``, default ``r``'s: the head's MTP layer runs the local experts)."""
        from k3train.planning.memory import whole_traces

        B, T = 1, r.cfg.train.seq_len // r.layout.cp  # one row (see ``run``)
        if whole_traces(r.cfg, r.layout.mbs, T):
            return None
        ep = ep or r.layout.ep
        key = (B, T, r.layout.cp) + ((ep,) if by_ep else ())
        if key not in memo:
            memo[key] = self._traced(r, fn, B, T, t_end, ep)
        return memo[key]

    def _traced(self, r: Row, fn: Any, B: int, T: int, t_end: float, ep: int) -> Any:
        """``fn(cfg, full model, fake mode, piece cache, B, T, deadline)`` on the :class:`EstimateCache`'s fake full
        model of ``ep`` (a piece with routed experts depends on their local count, ``memory.trace_piece``), None
        when the deadline passes."""
        from k3train.planning.memory import TraceDeadline

        c = self.cache
        try:
            return fn(r.cfg, c.full_model(r.cfg, ep, c.fake), c.fake, c.pieces, B, T, t_end)
        except TraceDeadline:
            return None

    @staticmethod
    def _too_big_follow_ups(r: Row, by_layout: dict[Layout, Row], seen: set[Layout], urgent: deque,
                            families: dict[tuple, list[Row]] | None = None) -> None:
        """After ``r`` was traced too big: every layout of its family (same pp, vpp, schedule, recompute, MoonEP;
        for a recompute layout also the family without it) that holds at least as much per rank is too big
        without a trace -- a ZeRO stage no higher (shards less),
        a micro-batch no smaller (more activations), cp no larger (longer sequence per rank; pp fixed, so dp is
        larger, which shards nothing ZeRO does not), ep no larger (more experts and their gradients, optimizer
        state and replica pool per rank) -- and its neighbours with less memory per rank (recompute twin first)
        are examined next, depth first, instead of when their step-time bounds come up (at K3 scale the
        fastest-bounded layouts hold 2-15x the device memory, and the budget would go to more of them)."""
        from dataclasses import replace

        lay = r.layout
        fam = (families or {}).get(_family(lay))
        if fam is None:  # no family index: the ZeRO twins only
            fam = [t for t in (by_layout.get(replace(lay, zero=z)) for z in range(lay.zero)) if t is not None]
        elif lay.recompute:  # keeping every activation holds more than recomputing them
            fam = fam + (families or {}).get(_family(replace(lay, recompute=False)), [])
        for twin in fam:
            t = twin.layout
            if (t not in seen and t.zero <= lay.zero and t.mbs >= lay.mbs and t.cp <= lay.cp and t.ep <= lay.ep
                    and t != lay):
                seen.add(t)
                twin.fits, twin.skipped = False, "needs more memory than a layout traced too big"
        # examined next, depth first (each holds less per rank than ``lay``): the recompute twin (at K3 scale a
        # fraction of the activations), the unpaired twin (F/B pairing keeps one more forward in flight and two
        # computes' transients at once: a micro-batch's worth), then half the micro-batch, twice the ep, one ZeRO
        # stage more, twice the cp (half the dp) -- a descent to the memory limit instead of the step-time order's
        # walk through ever more layouts of the same too-big kind. (Unpaired first, a too-big paired layout's
        # descent stayed unpaired: K3 at 4K chose an unpaired 38.9 s layout whose paired twin fits.)
        steps = [replace(lay, recompute=True)] if not lay.recompute else []
        steps += [replace(lay, overlap_ep=False)] if lay.overlap_ep else []
        if lay.mbs % 2 == 0:
            steps.append(replace(lay, mbs=lay.mbs // 2))
        steps.append(replace(lay, ep=lay.ep * 2))
        if lay.zero < 2:
            steps.append(replace(lay, zero=lay.zero + 1))
        if lay.dp % 2 == 0:
            steps.append(replace(lay, cp=lay.cp * 2, dp=lay.dp // 2))
        nxt = [by_layout[t] for t in steps if t in by_layout and t not in seen]
        urgent.extendleft(reversed(nxt))

    def trace(self, r: Row) -> None:
        from k3train.planning.memory import TraceTooBig, estimate

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


def _smaller(vals: list[dict[Any, Any] | None]) -> dict[Any, Any] | None:
    """Per key, the smallest of ``vals``' values (byte counts, or tuples of them elementwise); None if any is None
    (a trace stopped by its deadline)."""
    if any(v is None for v in vals):
        return None
    return {k: (min(v[k] for v in vals) if isinstance(vals[0][k], int)
                else tuple(min(x) for x in zip(*(v[k] for v in vals)))) for k in vals[0]}


def _family(lay: Layout) -> tuple:
    """Layouts whose per-rank memory orders by (zero, micro-batch, cp, ep) alone (``_too_big_follow_ups``)."""
    return (lay.pp, lay.vpp, lay.schedule, lay.recompute, lay.moonep, lay.overlap_ep)


def _sibling_key(lay: Layout) -> tuple:
    """Layouts that differ only in vpp and schedule (``Planner.run``: examined after one of them fits)."""
    return (lay.pp, lay.dp, lay.cp, lay.ep, lay.moonep, lay.zero, lay.mbs, lay.recompute, lay.overlap_ep)


def _core(r: Row) -> tuple:
    L = r.layout
    return (L.pp, L.vpp, L.dp, L.cp, L.ep, L.mbs, L.recompute, L.overlap_ep)


def _predicted_fits(planner: "Planner", res: PlanResult, r: Row, predict_one: Any) -> bool:
    """Whether ``r`` fits, predicting and tracing it here where branch and bound skipped it."""
    if r.pred is None:
        r.skipped, r.pred = "", predict_one(planner, r, res)
    if r.peak_bytes is None:
        planner.trace(r)
    return bool(r.fits)


def first_fitting(planner: "Planner", res: PlanResult, rows: Any, k: int, predict_one: Any) -> list[Row]:
    """The first ``k`` of ``rows`` that FIT (predicted and traced here where branch and bound skipped them)."""
    picked: list[Row] = []
    for r in rows:
        if len(picked) >= k:
            break
        if _predicted_fits(planner, res, r, predict_one):
            picked.append(r)
    return picked


def distinct_top(planner: "Planner", res: PlanResult, k: int, predict_one: Any) -> list[Row]:
    """The ``k`` fastest FITTING layouts by prediction with distinct parallel cores ``(pp, vpp, dp, cp, ep,
    micro-batch, recompute)`` -- what ``--measure`` runs (schedule / ZeRO / MoonEP variants of one core are
    predicted within a percent of each other, so a measured set of them would check noise, not the ranking).
    Rows not simulated yet enter at their step-time lower bound and are predicted when they reach the front, then
    re-enter at their prediction: a row is picked only when no other row can be faster (every bound is at most
    its prediction), so the chosen layout is always measured."""
    import heapq

    heap = [(r.pred.step_s if r.pred is not None else r.lower_bound_s, i, r)
            for i, r in enumerate(res.rows) if r.skipped != "bound"]
    heapq.heapify(heap)
    picked: list[Row] = []
    seen: set[tuple] = set()
    while heap and len(picked) < k:
        _, i, r = heapq.heappop(heap)
        if _core(r) in seen:
            continue
        if r.pred is None:
            r.skipped, r.pred = "", predict_one(planner, r, res)
            heapq.heappush(heap, (r.pred.step_s, i, r))
            continue
        if _predicted_fits(planner, res, r, predict_one):
            picked.append(r)
            seen.add(_core(r))
    return picked


def slowest_fitting(planner: "Planner", res: PlanResult, k: int, predict_one: Any) -> list[Row]:
    """The ``k`` fitting layouts with the largest step-time lower bounds (so the measured set spans the ranking)."""
    slow = sorted((r for r in res.rows if r.skipped != "bound"), key=lambda r: -r.lower_bound_s)
    return first_fitting(planner, res, slow, k, predict_one)


def _twin(lay: Layout) -> Layout:
    from dataclasses import replace

    return replace(lay, recompute=False)


# --------------------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------------------
def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def format_table(res: PlanResult, rows: list[Row]) -> str:
    cfg, W = res.base_cfg, res.world
    head = (f"{'#':>3} {'layout':<40} {'step s':>9} {'tok/s/dev':>10} {'MFU':>6} {'bubble':>6} {'comm':>6} "
            f"{'opt':>5} {'peak GiB':>9}  {'per stage GiB':<24} {'measured':>9}")
    lines = [head]
    for i, r in enumerate(rows, 1):
        p = r.pred
        tps = (r.tokens_per_s(cfg) or 0) / W
        stages = ",".join(f"{s / 2**30:.1f}" for s in r.stage_peaks[:8]) + ("..." if len(r.stage_peaks) > 8 else "")
        meas = f"{r.measured_step_s:9.3f}" if r.measured_step_s is not None else f"{'':>9}"
        lines.append(f"{i:>3} {r.layout.short():<40} {p.step_s:9.4g} {tps:10.4g} {100 * mfu(r, cfg, W, res.device.peak_flops):5.1f}% "
                     f"{100 * p.bubble / p.step_s:5.1f}% {100 * p.exposed_comm / p.step_s:5.1f}% "
                     f"{100 * p.optimizer / p.step_s:4.1f}% {('>' if r.peak_is_bound else '') + _gib(r.peak_bytes):>9}"
                     f"  {stages:<24} {meas}")
    return "\n".join(lines)


def plot(res: PlanResult, path: str, chosen: Row | None, mark: Row | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, W = res.base_cfg, res.world
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for fits, color, label in ((True, "tab:blue", "fits"), (False, "tab:red", "does not fit")):
        pts = [(r.peak_bytes / 2**30, (r.tokens_per_s(cfg) or 0) / W) for r in res.rows
               if r.pred is not None and r.peak_bytes is not None and bool(r.fits) == fits]
        if pts:
            ax.scatter(*zip(*pts), s=12, color=color, alpha=0.6, label=label)
    ax.axvline(res.device.hbm_bytes / 2**30, color="gray", ls="--", lw=1, label="device memory")
    for r, mk, lab in ((chosen, "*", "chosen"), (mark, "D", "reference")):
        if r is not None and r.pred is not None and r.peak_bytes is not None:
            ax.scatter([r.peak_bytes / 2**30], [(r.tokens_per_s(cfg) or 0) / W], s=160, marker=mk, color="k",
                       label=f"{lab}: {r.layout.short()}", zorder=3)
    ax.set_xlabel("peak memory of the worst rank (GiB)")
    ax.set_ylabel("predicted tokens/s per device")
    ax.set_title(f"{cfg.source or ''}: {W} x {res.device.name}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------------------------
PHASES = ("step_time_s", "time_forward_backward_s", "time_grad_norm_s", "time_optimizer_s")


def measure_step(config: str, overrides: list[str], world: int, steps: int = 4, threads: int = 1,
                 timeout: float = 1800) -> dict[str, float]:
    """Medians of ``PHASES`` (metrics.jsonl: the step, and rank 0's forward+backward, gradient norm and optimizer
    step) over steps 3..``steps`` (2..``steps`` for fewer than 5 steps) of a real torchrun training run
    (``threads`` intra-op threads per rank: the calibration's). The first two steps are warm-up: the first
    allocates optimizer state, and the second was still 5-10% slower in runs here."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="k3plan_") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        from k3train.runtime.process_groups import child_pythonpath  # noqa: PLC0415
        env.update(WANDB_MODE="disabled", OMP_NUM_THREADS=str(threads), PYTHONPATH=child_pythonpath(root))
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", f"--nproc_per_node={world}", "-m", "k3train.train", "--config", config,
               *overrides, f"--train.out_dir={tmp}/run", f"--train.steps={steps}", "--checkpoint.resume=none",
               "--checkpoint.interval=0", "--checkpoint.save_final=false", "--logging.wandb=false",
               "--logging.peak_flops=1e12", "--train.eval_interval=0"]
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"measure run failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
        recs = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    skip = 2 if steps >= 5 else 1
    kept = [r for r in recs if r["step"] > skip]
    if not kept:
        raise RuntimeError("measure run logged no step after the first")
    out = {}
    for k in PHASES:
        ts = sorted(r.get(k, float("nan")) for r in kept)
        out[k] = ts[len(ts) // 2]
    return out


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        out = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else float("nan")
