"""The step-time lower bound: what no simulation of a layout can come in under (the search's order and its
branch-and-bound cut)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from k3train.planning.programs import pairs_actions
from k3train.planning.step_time.compute import layer_compute
from k3train.planning.step_time.costs import action_costs
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.facts import ParamFacts
from k3train.planning.step_time.optimizer import optimizer_seconds

_MEMO: dict[tuple, Any] = {}


def compute_lower_bound(cfg: Any, lay: Any, part: Any, dev: Device, facts: ParamFacts, layer_times: Any,
                        skew: float, opt_times: dict[str, float] | None) -> float:
    """A lower bound on :func:`~k3train.planning.step_time.predict.predict`: per pipeline rank, its own work (at
    the best rate its replicas allow)
    after the first micro-batch's forward through the stages before its first and before that micro-batch's
    backward back through them -- or one micro-batch's forward + backward chain through all virtual stages,
    whichever is longest -- plus the worst stage's optimizer share. Under F/B pairing a rank's work takes at
    least its compute and at least its blocked communication (both sides share the rank's compute and its link,
    :func:`pair_seconds`), unpaired their sum. Used to skip simulating layouts that cannot make the top."""
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
            edge = sum(c.f[v] + c.f_comm[v] + c.b[v] + c.b_comm[v] for v in range(first))
            ranks.append((sum(c.f[v] + c.b[v] for v in mine) * M, sum(c.f_comm[v] + c.b_comm[v] for v in mine) * M,
                          edge))
        # one micro-batch's forward through every virtual stage and its backward back are a dependency chain
        chain = sum(c.f[v] + c.b[v] + c.f_comm[v] + c.b_comm[v] for v in range(part.num_stages))
        _MEMO[kb] = (ranks, chain, part)
    ko = ("lbo", id(part), lay.ep, lay.zero, lay.dp * lay.cp, id(facts), id(dev), id(opt_times))
    if ko not in _MEMO:
        _MEMO[ko] = (max(optimizer_seconds(facts, cfg, dev, part, r, lay, opt_times) for r in range(lay.pp)), part)
    rate = dev.rank_speed(lay.dp * lay.cp)  # at least the busiest rank's replicas compute with it
    ranks, chain, _ = _MEMO[kb]
    busy = max(edge + (max(comp / rate, comm) if paired else (comp + comm) / rate) for comp, comm, edge in ranks)
    return max(busy, chain) + _MEMO[ko][0] / dev.rank_speed(lay.pp * lay.dp * lay.cp)


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
