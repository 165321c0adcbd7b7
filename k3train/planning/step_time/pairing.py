"""F/B pairing (``parallel.overlap_ep``, parallel/pairing.py): an F and a B of two micro-batches at once, each on
its own thread, sharing the rank's compute and its link."""
from __future__ import annotations

from typing import Any

from k3train.planning.dtypes import dtype_bytes
from k3train.planning.step_time.compute import routed_share
from k3train.planning.step_time.costs import layer_terms
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.overlap import layer_ops, own_row_share, side_timeline


def side_phases(cfg: Any, dev: Device, lay: Any, part: Any, layer_times: Any,
                skew: float) -> tuple[list[list], list[list]]:
    """Per virtual stage, its forward and its backward of one micro-batch as the sequences of compute (``'c'``,
    seconds at full speed) and blocked communication (``'n'``, wall seconds) phases their thread runs: each layer
    as :func:`layer_ops` issues it, through :func:`side_timeline` (a MoE layer's transfers overlap its own expert
    compute as moonep/dispatcher.py overlaps them; what is left is a wait). The routed experts' share of a MoE
    layer's compute is their share of its FLOPs (``partition.layer_cost``); under recompute the backward re-runs
    each layer's forward first. The stage's pieces as :func:`action_costs` sums them. Two approximations: a side's
    own overlap is taken at full compute speed (paired, its compute runs slower, which would hide more), and its
    transfers in flight while it computes do not slow the other side's."""
    (emb, layers, head), _, _, sent = layer_terms(cfg, dev, lay, layer_times, skew)
    L = len(layers)
    split, es = cfg.parallel.expert_wgrad_split, dtype_bytes(cfg)

    def phases(d: str, i: int, c: float, ref: float, kind: dict[str, tuple[float, float]]) -> list:
        # ref: the layer's own compute (the head piece: the last layer's, for the MTP layer's experts)
        experts = min(c, routed_share(cfg, lay, i, skew) * ref) if "ep_all_to_all" in kind else 0.0
        ops = layer_ops(d, kind, experts, c - experts, own_row_share(lay, skew, kind), split, es)
        return side_timeline(ops, in_line=dev.shares_cores)[0]

    def fwd(i: int, t: list[float], kind: dict[str, tuple[float, float]]) -> list[tuple[str, float]]:
        return phases("f", i, t[0], layers[min(i, L - 1)][0], kind)

    def bwd(i: int, t: list[float], kind: dict[str, tuple[float, float]]) -> list[tuple[str, float]]:
        ref = layers[min(i, L - 1)]
        if lay.recompute:
            return fwd(i, t, kind) + phases("b", i, t[2] - t[0], ref[2] - ref[0], kind)
        return phases("b", i, t[1], ref[1], kind)

    n = part.num_stages
    fs, bs = [], []
    for v in range(n):
        a, e = part.bounds[v]
        pieces = [(i, layers[i], sent[i]) for i in range(a, e)]
        if v == n - 1:  # the head, with the MTP layer's communication (comm_per_layer's extra entry)
            extra: dict[str, tuple[float, float]] = {}
            for d in sent[L:]:
                for k, (x, y) in d.items():
                    extra[k] = (extra.get(k, (0.0, 0.0))[0] + x, extra.get(k, (0.0, 0.0))[1] + y)
            pieces.append((L, head, extra))
        f_ph: list[tuple[str, float]] = [("c", emb[0])] if v == 0 else []
        b_ph: list[tuple[str, float]] = []
        for i, t, kind in pieces:
            f_ph += fwd(i, t, kind)
        for i, t, kind in reversed(pieces):
            b_ph += bwd(i, t, kind)
        if v == 0:
            b_ph.append(("c", emb[2] - emb[0] if lay.recompute else emb[1]))
        fs.append([p for p in f_ph if p[1] > 0])
        bs.append([p for p in b_ph if p[1] > 0])
    return fs, bs


def pair_seconds(f_ph: list[tuple[str, float]], b_ph: list[tuple[str, float]], rate: float = 1.0) -> float:
    """Wall seconds of one paired action: the two sides' phase sequences (:func:`side_phases`) run at once, each
    phase as soon as its side's previous one ends, sharing the rank's compute (``'c'``: ``rate`` of full speed,
    split equally while both sides compute, as two threads' kernels interleave) and its link (``'n'``: both sides'
    collectives leave the same rank, split equally while both communicate)."""
    return max(pair_side_ends(f_ph, b_ph, rate))


def pair_side_ends(f_ph: list[tuple[str, float]], b_ph: list[tuple[str, float]],
                   rate: float = 1.0) -> tuple[float, float]:
    """``(F side's end, B side's end)`` in wall seconds from the pair's start (:func:`pair_seconds`' model; a
    side left alone runs its phases at full share)."""
    sides = (list(f_ph), list(b_ph))
    idx, left = [0, 0], [sides[0][0][1] if sides[0] else 0.0, sides[1][0][1] if sides[1] else 0.0]
    t = 0.0
    ends = [0.0, 0.0]
    while idx[0] < len(sides[0]) or idx[1] < len(sides[1]):
        active = [sd for sd in (0, 1) if idx[sd] < len(sides[sd])]
        kinds = {sd: sides[sd][idx[sd]][0] for sd in active}
        speed = {sd: (rate if kinds[sd] == "c" else 1.0) / sum(kinds[o] == kinds[sd] for o in active)
                 for sd in active}
        dt = min(left[sd] / speed[sd] for sd in active)
        t += dt
        for sd in active:
            left[sd] -= dt * speed[sd]
            if left[sd] <= 1e-12 * max(1.0, t):
                idx[sd] += 1
                left[sd] = sides[sd][idx[sd]][1] if idx[sd] < len(sides[sd]) else 0.0
                if idx[sd] == len(sides[sd]):
                    ends[sd] = t
    return ends[0], ends[1]
