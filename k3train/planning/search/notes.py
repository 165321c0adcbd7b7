"""What a plan says about the layouts it did not rank: how many, and why."""
from __future__ import annotations

from typing import Any

from k3train.planning.search.rows import Row, SearchStatus


def memory_bound_note(n_bound: int, hbm: float) -> str:
    return (f"{n_bound} layouts exceed {hbm / 2**30:.1f} GiB on weights + gradients + "
            f"optimizer state, or weights + optimizer state + the partial sums of each forward before "
            f"the first backward (with what each FFN sublayer's traced piece keeps), alone: dropped without a "
            f"trace")


def plan_notes(rows: list[Row], planner: Any, counts: Any, status: SearchStatus) -> list[str]:
    """The notes of a plan: what its bounds left out, why each row it did not rank was skipped, what it traced."""
    hbm = planner.dev.hbm_bytes
    notes = []
    n_bound = (sum(r.skipped == "bound" for r in rows) - counts.n_mixer - counts.n_late + counts.dropped_cores
               + counts.dropped_families)
    if n_bound:
        notes.append(memory_bound_note(n_bound, hbm))
    if counts.dropped_families:
        notes.append(f"{counts.dropped_families} of them with their family (pp, dp, cp, ep): even the average "
                     f"stage's weights, gradients and optimizer state at the top ZeRO stage are over it")
    if counts.dropped_cores:
        notes.append(f"{counts.dropped_cores} of them with their core: even its least memory-hungry layout (top "
                     f"ZeRO stage, recomputation, no MoonEP, unpaired) is over it")
    notes += skip_notes(rows, planner, counts.n_mixer, counts.n_late)
    if counts.n_upper:
        notes.append(f"{counts.n_upper} layouts fit on an upper bound of their peak, untraced (peak '<=' in the "
                     f"table; --exact-memory traces them)")
    notes.append(f"memory traced for {counts.n_traced} layouts in {counts.t_mem:.1f} s; {counts.n_sim} layouts "
                 f"simulated in {counts.t_sim:.1f} s")
    return notes


def skip_notes(rows: list[Row], planner: Any, n_mixer: int, n_late: int) -> list[str]:
    """The notes on the rows the search dropped on the refined bounds (``n_mixer``: with the token mixers' pieces,
    ``n_late``: with the end pieces) and on each reason a row was skipped, in that order."""
    hbm = planner.dev.hbm_bytes
    why = {
        "slower": "layouts not simulated/traced: their step-time lower bound (or prediction) is above the "
                  f"{planner.top}th fitting layout's prediction",
        "dominated": "recompute layouts skipped: their twin without recompute fits and is faster",
        "needs more memory than a layout traced too big":
            "layouts not traced: a layout of the same pp / vpp / schedule / MoonEP, recompute no less, a ZeRO "
            "stage, cp and ep no lower and a micro-batch no larger (so no more memory per rank) was traced "
            "too big",
        "trace budget": f"layouts predicted but not traced: memory trace budget ({planner.trace_budget_s:.0f} s) "
                        "spent",
        "simulation budget": "layouts not simulated: simulation budget "
                             f"({planner.sim_budget_s:.0f} s) spent",
        "time budget": f"layouts not simulated or traced: the plan's time budget ({planner.time_budget_s:.0f} s, "
                       "enumeration included) spent",
    }
    notes = []
    if n_mixer:
        notes.append(f"{n_mixer} layouts exceed {hbm / 2**30:.1f} GiB on that bound with their "
                     f"token mixers' pieces (traced at a layout's cp when the first layout of that cp came up): "
                     f"dropped without a simulation")
    if n_late:
        notes.append(f"{n_late} layouts exceed {hbm / 2**30:.1f} GiB on that bound with the first "
                     f"and last stages' pieces (the embedding, the LM head + MTP layer: traced at a layout's cp "
                     f"when it came up for a trace, as its estimate would): dropped without the rest")
    for reason, text in why.items():
        n = sum(r.skipped == reason for r in rows)
        if n:
            notes.append(f"{n} {text}")
    return notes
