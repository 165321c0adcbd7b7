"""The layouts ``tools/plan.py --measure`` runs: the fastest fitting ones with distinct parallel cores, and a few of
the slowest (predicted and traced here where the search skipped them)."""
from __future__ import annotations

import heapq
from typing import Any

from k3train.planning.search.planner import Planner
from k3train.planning.search.rows import PlanResult, Row


def _core(r: Row) -> tuple:
    L = r.layout
    return (L.pp, L.vpp, L.dp, L.cp, L.ep, L.mbs, L.recompute, L.overlap_ep)


def _predicted_fits(planner: Planner, res: PlanResult, r: Row, predict_one: Any) -> bool:
    """Whether ``r`` fits, predicting and tracing it here where branch and bound skipped it."""
    if r.pred is None:
        r.skipped, r.pred = "", predict_one(planner, r, res)
    if r.peak_bytes is None:
        planner.trace(r)
    return bool(r.fits)


def first_fitting(planner: Planner, res: PlanResult, rows: Any, k: int, predict_one: Any) -> list[Row]:
    """The first ``k`` of ``rows`` that FIT (predicted and traced here where branch and bound skipped them)."""
    picked: list[Row] = []
    for r in rows:
        if len(picked) >= k:
            break
        if _predicted_fits(planner, res, r, predict_one):
            picked.append(r)
    return picked


def distinct_top(planner: Planner, res: PlanResult, k: int, predict_one: Any) -> list[Row]:
    """The ``k`` fastest FITTING layouts by prediction with distinct parallel cores ``(pp, vpp, dp, cp, ep,
    micro-batch, recompute)`` -- what ``--measure`` runs (schedule / ZeRO / MoonEP variants of one core are
    predicted within a percent of each other, so a measured set of them would check noise, not the ranking).
    Rows not simulated yet enter at their step-time lower bound and are predicted when they reach the front, then
    re-enter at their prediction: a row is picked only when no other row can be faster (every bound is at most
    its prediction), so the chosen layout is always measured."""
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


def slowest_fitting(planner: Planner, res: PlanResult, k: int, predict_one: Any) -> list[Row]:
    """The ``k`` fitting layouts with the largest step-time lower bounds (so the measured set spans the ranking)."""
    slow = sorted((r for r in res.rows if r.skipped != "bound"), key=lambda r: -r.lower_bound_s)
    return first_fitting(planner, res, slow, k, predict_one)
