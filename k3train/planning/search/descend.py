"""The descent: what a layout traced too big says about its family (marked too big without a trace), and which of
its neighbours, holding less per rank, are examined next; the family key it reads."""
from __future__ import annotations

from collections import deque
from dataclasses import replace

from k3train.planning.search.layouts import Layout
from k3train.planning.search.rows import Row


def family_key(lay: Layout) -> tuple:
    """Layouts whose per-rank memory orders by (zero, micro-batch, cp, ep) alone (:func:`too_big_follow_ups`)."""
    return (lay.pp, lay.vpp, lay.schedule, lay.recompute, lay.moonep, lay.overlap_ep)


def without_recompute(lay: Layout) -> Layout:
    """``lay``'s twin without recomputation: a recompute layout is dominated by it when it fits (same everything,
    strictly more compute)."""
    return replace(lay, recompute=False)


def too_big_follow_ups(r: Row, by_layout: dict[Layout, Row], seen: set[Layout], urgent: deque,
                       families: dict[tuple, list[Row]] | None = None) -> None:
    """After ``r`` was traced too big: every layout of its family (same pp, vpp, schedule, recompute, MoonEP;
    for a recompute layout also the family without it) that holds at least as much per rank is too big
    without a trace -- a ZeRO stage no higher (shards less),
    a micro-batch no smaller (more activations), cp no larger (longer sequence per rank; pp fixed, so dp is
    larger, which shards nothing ZeRO does not), ep no larger (more experts and their gradients, optimizer
    state and replica pool per rank) -- and its neighbours with less memory per rank (recompute twin first)
    are examined next, depth first, instead of when their step-time bounds come up (at K3 scale the
    fastest-bounded layouts hold 2-15x the device memory, and the budget would go to more of them)."""
    lay = r.layout
    fam = (families or {}).get(family_key(lay))
    if fam is None:  # no family index: the ZeRO twins only
        fam = [t for t in (by_layout.get(replace(lay, zero=z)) for z in range(lay.zero)) if t is not None]
    elif lay.recompute:  # keeping every activation holds more than recomputing them
        fam = fam + (families or {}).get(family_key(replace(lay, recompute=False)), [])
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
