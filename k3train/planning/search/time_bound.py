"""The step-time lower bound: what no simulation of a layout can come in under (the search's order and its
branch-and-bound cut)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from k3train.planning.dtypes import dtype_bytes
from k3train.planning.programs import pairs_actions
from k3train.planning.step_time.compute import layer_compute
from k3train.planning.step_time.costs import action_costs
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.facts import ParamFacts
from k3train.planning.step_time.optimizer import optimizer_seconds
from k3train.planning.step_time.pairing import pair_seconds, side_phases
from k3train.planning.step_time.predict import chunk_reduce_seconds, param_gather_seconds, small_collectives_s

_MEMO: dict[tuple, Any] = {}


def compute_lower_bound(cfg: Any, lay: Any, part: Any, dev: Device, facts: ParamFacts, layer_times: Any,
                        skew: float, opt_times: dict[str, float] | None, exact_pairs: bool = False) -> float:
    """A lower bound on :func:`~k3train.planning.step_time.predict.predict`: per pipeline rank, its own work (at
    the best rate its replicas allow)
    after the first micro-batch's forward through the stages before its first and before that micro-batch's
    backward back through them -- or one micro-batch's forward + backward chain through all virtual stages,
    whichever is longest -- then its gradient reductions (at least its last chunk's after its last compute, and at
    least all of its chunks' back to back on its link), then what the step adds after the slowest rank's:
    the worst stage's optimizer share, ZeRO's parameter gather and the small collectives, exactly as the
    prediction adds them. Under F/B pairing a rank's work takes at least its compute and at least its blocked
    communication (both sides share the rank's compute and its link, :func:`pair_seconds`), unpaired their sum;
    and at least what :func:`_paired_work` says (``exact_pairs``: with every pair of its stages' simulated wall
    time, a refinement the search makes when a layout comes up). Used to skip simulating layouts that cannot make
    the top."""
    M = cfg.train.grad_accum_steps
    paired = pairs_actions(cfg)
    # memoised: the busy part does not depend on zero, the optimizer part not on the micro-batch shape
    kb = ("lb", id(part), lay.mbs, lay.cp, lay.ep, lay.moonep, lay.recompute, M, id(dev), id(layer_times), skew,
          paired)
    if kb not in _MEMO:
        c = action_costs(cfg, dev, lay, part, None, layer_times, skew)  # (no messages: the bound reads none)
        ranks = []
        for r in range(lay.pp):
            mine = part.local_stages(r)
            first = min(mine)
            # nothing of rank r starts before micro-batch 0's forward reached its first stage, and the step ends
            # no sooner than its last backward's gradient went back down through the stages before that one
            fwd = sum(c.f[v] + c.f_comm[v] for v in range(first))
            edge = fwd + sum(c.b[v] + c.b_comm[v] for v in range(first))
            ranks.append((sum(c.f[v] + c.b[v] for v in mine) * M, sum(c.f_comm[v] + c.b_comm[v] for v in mine) * M,
                          edge, fwd))
        # one micro-batch's forward through every virtual stage and its backward back are a dependency chain
        chain = sum(c.f[v] + c.b[v] + c.f_comm[v] + c.b_comm[v] for v in range(part.num_stages))
        _MEMO[kb] = (ranks, chain, part, c)
    ko = ("lbo", id(part), lay.ep, lay.zero, lay.dp, lay.cp, id(facts), id(dev), id(opt_times))
    if ko not in _MEMO:
        _MEMO[ko] = (_after_pipeline(cfg, lay, part, dev, facts, opt_times), part)
    rate = dev.rank_speed(lay.dp * lay.cp)  # at least the busiest rank's replicas compute with it
    ranks, chain, _, c = _MEMO[kb]
    reduce, after = _MEMO[ko][0]
    # a rank's gradient reductions start at its chunks' last backwards, one after another on one link: they end
    # no sooner than all of them back to back, nor than its last chunk's after its own last compute (which
    # follows micro-batch 0's forward to it and its work); the slowest rank's, no sooner than the shortest
    # chunk reduction of any after the pipeline ends
    kw = (kb, rate, exact_pairs)
    if kw not in _MEMO:
        walls = _pair_walls(cfg, dev, lay, part, layer_times, skew) if exact_pairs and paired else None
        _MEMO[kw] = [(max(comp / rate, comm, M * _paired_work(c, part.local_stages(r), rate, walls and walls[r]))
                      if paired else (comp + comm) / rate) for r, (comp, comm, _, _) in enumerate(ranks)]
    work = _MEMO[kw]
    pipe = max(chain, *(w + edge for w, (_, _, edge, _) in zip(work, ranks)))
    finish = max(pipe + min(lo for lo, _ in reduce),
                 *(max(fwd + w + lo, total) for w, (_, _, _, fwd), (lo, total) in zip(work, ranks, reduce)))
    return finish + after


def _pair_walls(cfg: Any, dev: Device, lay: Any, part: Any, layer_times: Any,
                skew: float) -> list[dict[tuple[int, int], float]]:
    """Per pipeline rank, per (forward's, backward's) local virtual stage: the wall seconds of that pair at full
    compute speed (:func:`~k3train.planning.step_time.pairing.pair_seconds` of their sides' phases, as the
    simulation runs a paired action)."""
    fs, bs = side_phases(cfg, dev, lay, part, layer_times, skew)
    return [{(v, w): pair_seconds(fs[v], bs[w]) for v in part.local_stages(r) for w in part.local_stages(r)}
            for r in range(lay.pp)]


def _paired_work(c: Any, mine: list[int], rate: float, walls: dict[tuple[int, int], float] | None) -> float:
    """A lower bound on one micro-batch's share of a paired rank's busy time: each forward of stage v costs a_v
    and each backward of stage w b_w, with a_v + b_w at most what a pair of them takes in the simulation and
    each at most what it takes alone; whichever actions the schedule pairs, the rank is busy at least the sum
    (two choices of the split, the larger). A pair (:func:`~k3train.planning.step_time.pairing.pair_seconds`)
    takes at least its two computes one after the other (one device), each side's own phases one after the
    other, and both sides' blocked communication one after the other (one link); with ``walls`` (at full
    speed), at least its wall time with its compute at ``rate``."""
    alone_f = {v: c.f[v] / rate + c.f_comm[v] for v in mine}
    alone_b = {w: c.b[w] / rate + c.b_comm[w] for w in mine}
    pair = {(v, w): max((c.f[v] + c.b[w]) / rate, alone_f[v], alone_b[w], c.f_comm[v] + c.b_comm[w])
            for v in mine for w in mine}
    if walls is not None:
        pair = {(v, w): max(t, (c.f[v] + c.b[w]) / rate + walls[v, w] - c.f[v] - c.b[w]) for (v, w), t in pair.items()}
    by_b = sum(alone_b.values()) + sum(min(alone_f[v], *(pair[v, w] - alone_b[w] for w in mine)) for v in mine)
    by_f = sum(alone_f.values()) + sum(min(alone_b[w], *(pair[v, w] - alone_f[v] for v in mine)) for w in mine)
    return max(by_b, by_f)


def _after_pipeline(cfg: Any, lay: Any, part: Any, dev: Device, facts: ParamFacts,
                    opt_times: dict[str, float] | None) -> tuple[list[tuple[float, float]], float]:
    """What :func:`~k3train.planning.step_time.predict.predict` adds to the pipeline, as it computes it: per
    pipeline rank ``(its shortest chunk reduction, all its chunk reductions)``, and the optimizer, ZeRO's
    parameter gather and the small collectives after the slowest rank's reductions end."""
    es = dtype_bytes(cfg)
    reduce, opt, gather = [], [], []
    for r in range(lay.pp):
        d, e, _ = facts.stage_numel(part, r, lay.ep)
        dur = chunk_reduce_seconds(lay, part, dev, r, d * es, e * es)
        reduce.append((min(dur, default=0.0), sum(dur)))
        opt.append(optimizer_seconds(facts, cfg, dev, part, r, lay, opt_times))
        gather.append(param_gather_seconds(lay, dev, r, d * es, e * es))
    return reduce, (max(opt) / dev.rank_speed(lay.pp * lay.dp * lay.cp) + max(gather)
                    + small_collectives_s(lay, dev))


def family_lower_bound(cfg: Any, lay: Any, whole: Any, dev: Device, layer_times: Any, skew: float) -> float:
    """A lower bound on :func:`compute_lower_bound` of EVERY layout with ``lay``'s pp, dp, cp, micro-batch size,
    ep and MoonEP setting -- any vpp, schedule, ZeRO stage, recomputation or pairing: the busiest pipeline rank
    works at least the average rank's share of every stage's work (``whole``: the one-stage partition, whose
    stage holds every layer, the embedding and the head: the sums of any partition's stages), paired or not,
    and one micro-batch's forward and backward chain through every stage; without recomputation, which only adds
    work, and without the optimizer (``cfg``: a validated config of the family, ``lay`` its layout)."""
    lay0 = replace(lay, recompute=False)
    key = ("family", id(whole), lay.mbs, lay.cp, lay.ep, lay.moonep, id(dev), id(layer_times), skew)
    if key not in _MEMO:
        c = action_costs(cfg, dev, lay0, whole, None, layer_times, skew)
        _MEMO[key] = ((c.f[0] + c.b[0], c.f_comm[0] + c.b_comm[0]), whole)
    (comp, comm), _ = _MEMO[key]
    rate = dev.rank_speed(lay.dp * lay.cp)
    M = cfg.train.grad_accum_steps
    return max(M * min(max(comp / rate, comm), (comp + comm) / rate) / lay.pp, comp + comm)


def family_compute_bound(cfg: Any, lay: Any, dev: Device, layer_times: Any, skew: float) -> float:
    """A lower bound on :func:`family_lower_bound` from the compute alone (its terms at no communication; the
    per-piece compute of :func:`~k3train.planning.step_time.compute.layer_compute` summed over the whole model,
    as the one-stage partition's stage holds it): a thousandth of its cost, so the search orders the families by
    it and computes their communication only for those it reaches."""
    key = ("fcomp", id(cfg.model), lay.mbs, lay.cp, lay.ep, lay.moonep, id(dev), id(layer_times), skew)
    if key not in _MEMO:
        emb, layers, head = layer_compute(cfg, dev, replace(lay, recompute=False), layer_times, skew)
        _MEMO[key] = (emb[0] + emb[1] + head[0] + head[1] + sum(x[0] + x[1] for x in layers), cfg.model)
    comp = _MEMO[key][0]
    M = cfg.train.grad_accum_steps
    return max(M * comp / dev.rank_speed(lay.dp * lay.cp) / lay.pp, comp)
