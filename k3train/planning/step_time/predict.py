"""The predicted seconds of one optimizer step: the simulated pipeline, then the data-parallel reductions, the
optimizer, ZeRO's parameter gather, the per-step small collectives and the host's work (cpu)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from k3train.planning.dtypes import dtype_bytes
from k3train.planning.programs import cached_pair_programs, pairs_actions
from k3train.planning.step_time.comm import IN_ACTION_KINDS
from k3train.planning.step_time.compute import anchor_of
from k3train.planning.step_time.costs import action_costs
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.facts import ParamFacts
from k3train.planning.step_time.links import group_link, ring_time
from k3train.planning.step_time.optimizer import optimizer_seconds
from k3train.planning.step_time.pairing import side_phases
from k3train.planning.step_time.simulate import simulate_programs
from parallel.pipeline.attnres_comm import AttnResCommPlan


@dataclass
class Prediction:
    step_s: float
    compute: float
    exposed_comm: float
    bubble: float
    optimizer: float
    host: float = 0.0  # cpu: the gradient norm's own work and the step's host work outside the phases (anchor)
    detail: dict[str, Any] = field(default_factory=dict)

    def breakdown(self) -> dict[str, float]:
        return {"compute": self.compute, "exposed_comm": self.exposed_comm, "bubble": self.bubble,
                "optimizer": self.optimizer, "host": self.host}


def predict(cfg: Any, lay: Any, part: Any, programs: list[list[Any]], dev: Device, facts: ParamFacts,
            layer_times: Any = None, skew: float = 1.5, opt_times: dict[str, float] | None = None,
            split_p2p: bool = False, sims: dict[tuple, Any] | None = None) -> Prediction:
    """Predicted seconds of one optimizer step of ``cfg`` under layout ``lay`` (:mod:`k3train.planning.step_time`).
    ``detail['exposed_by_kind']`` splits the exposed communication by what it is (it sums to ``exposed_comm``):
    the in-action kinds of :data:`IN_ACTION_KINDS` on the critical pipeline rank, the gradient reduction left after
    the pipeline, ZeRO's parameter all-gather and the per-step small collectives. ``split_p2p``: the programs are
    simulated once more with free pipeline messages; ``detail['p2p_in_bubble_s']`` is how much longer the
    pipeline takes for its point-to-point transfers (a part of the bubble). ``sims``: the simulations of the
    pipeline kept across calls (the layouts that differ only in their ZeRO stage simulate the same programs at
    the same costs: the planner's speed-up; the caller keeps the programs and the partition alive)."""
    plan = AttnResCommPlan(part, cfg.parallel.attnres_comm) if lay.pp > 1 else None
    costs = action_costs(cfg, dev, lay, part, plan, layer_times, skew)
    dpcp = lay.dp * lay.cp
    paired = pairs_actions(cfg)
    pairs = None
    if paired:  # parallel.overlap_ep: the runner's own pairing of the programs (parallel/pipeline/runner.py)
        programs, firsts = cached_pair_programs(programs, lay.pp, part.vpp)
        pairs = (firsts, *side_phases(cfg, dev, lay, part, layer_times, skew))
    sk = (id(programs), id(part), id(dev), id(layer_times), skew, lay.mbs, lay.cp, lay.ep, lay.moonep, lay.recompute,
          dpcp, paired)
    sim = sims.get(sk) if sims is not None else None
    if sim is None:
        sim = simulate_programs(programs, lay.pp, part.vpp, costs, dpcp, dev.rank_speed if dev.shares_cores else None,
                                pairs)
        if sims is not None:
            sims[sk] = sim
    es = dtype_bytes(cfg)
    anchor = anchor_of(layer_times, cfg)
    total_numel = sum(p[0] + p[1] for p in facts.pieces.values())
    finish, opt, bcast, norm = [], [], [], []
    for r in range(lay.pp):
        d, e, _ = facts.stage_numel(part, r, lay.ep)
        finish.append(max(sim.end[r], _grad_reduce_end(sim, lay, part, dev, r, d * es, e * es)))
        # every rank of the host updates at the same time
        opt.append(optimizer_seconds(facts, cfg, dev, part, r, lay, opt_times) / dev.rank_speed(lay.pp * dpcp))
        if anchor is not None:  # the norm's local work: the rank's share of the parameters' elements
            norm.append(anchor.grad_norm_s * (d + e) / max(1.0, total_numel) / dev.rank_speed(lay.pp * dpcp))
        bcast.append(param_gather_seconds(lay, dev, r, d * es, e * es))
    fixed = small_collectives_s(lay, dev)
    # the breakdown is the bottleneck's: the pipeline rank with the most work (its idle time is the bubble)
    crit = max(range(lay.pp), key=lambda r: (sim.busy_compute[r] + sim.busy_comm[r], finish[r]))
    host = (max(norm) + anchor.host_step_s / dev.rank_speed(lay.pp * dpcp)) if anchor is not None else 0.0
    step = max(finish) + max(opt) + max(bcast) + fixed + host
    compute = sim.busy_compute[crit]
    in_action = sim.busy_comm[crit]
    bubble = max(0.0, sim.makespan - compute - in_action)
    optimizer = max(opt)
    exposed = max(0.0, step - compute - bubble - optimizer - host)
    # the critical rank's in-action seconds (simulated at wall speed) shared out as its stages' terms are
    mine = part.local_stages(crit)
    total = sum(costs.f_comm[v] + costs.b_comm[v] for v in mine)
    by_kind = {k: in_action * sum(costs.comm_kinds[v][k] for v in mine) / total if total > 0 else 0.0
               for k in IN_ACTION_KINDS}
    by_kind.update(grad_reduce=max(finish) - sim.makespan, zero_param_gather=max(bcast), small_collectives=fixed)
    detail = {"pipeline_s": sim.makespan, "in_action_comm_s": in_action, "dp_reduce_s": max(finish) - sim.makespan,
              "param_bcast_s": max(bcast), "fixed_collectives_s": fixed, "critical_pp_rank": crit,
              "stage_f_s": costs.f, "stage_b_s": costs.b, "exposed_by_kind": by_kind}
    detail["paired_fb"] = paired
    if split_p2p:
        free = dataclasses.replace(costs, msg_s={})
        alone = simulate_programs(programs, lay.pp, part.vpp, free, dpcp,
                                  dev.rank_speed if dev.shares_cores else None, pairs)
        detail["p2p_in_bubble_s"] = max(0.0, sim.makespan - alone.makespan)
    return Prediction(step_s=step, compute=compute, exposed_comm=exposed, bubble=bubble, optimizer=optimizer,
                      host=host, detail=detail)


def _stage_groups(lay: Any, r: int) -> tuple[range, range]:
    """ParallelDims' groups of rank (r, 0, 0): dp_cp = the stage's dp*cp consecutive ranks, edp = every ep-th."""
    dpcp = lay.dp * lay.cp
    return range(r * dpcp, (r + 1) * dpcp), range(r * dpcp, (r + 1) * dpcp, lay.ep)


def param_gather_seconds(lay: Any, dev: Device, r: int, dense_bytes: float, expert_bytes: float) -> float:
    """ZeRO's parameter all-gather of pipeline rank ``r`` after the optimizer (one broadcast per owner of the
    group; none without ZeRO); ``dense_bytes`` / ``expert_bytes``: the stage's."""
    if lay.zero == 0:
        return 0.0
    dg, eg = _stage_groups(lay, r)
    return (ring_time("all_gather", dense_bytes, dg, dev, calls=len(dg))
            + ring_time("all_gather", expert_bytes, eg, dev, calls=len(eg)))


def chunk_reduce_seconds(lay: Any, part: Any, dev: Device, r: int, dense_bytes: float,
                         expert_bytes: float) -> list[float]:
    """Per local chunk of pipeline rank ``r``: the seconds of its gradient reduction, issued at its last backward
    (parallelize.set_chunk_backward_hook): ZeRO-2 one bucketed dist.reduce per owner of the group, ZeRO 0 / 1 an
    all-reduce (optim/zero.py), of its layers' share of the stage's ``dense_bytes`` / ``expert_bytes``."""
    dg, eg = _stage_groups(lay, r)
    chunks = part.local_chunks(r)
    n = max(1, sum(b - a for a, b in chunks))
    out = []
    for s, e_ in chunks:
        share = (e_ - s) / n
        if lay.zero == 2:
            out.append(ring_time("reduce_scatter", dense_bytes * share, dg, dev, calls=len(dg))
                       + ring_time("reduce_scatter", expert_bytes * share, eg, dev, calls=len(eg)))
        else:
            out.append(ring_time("all_reduce", dense_bytes * share, dg, dev)
                       + ring_time("all_reduce", expert_bytes * share, eg, dev))
    return out


def _grad_reduce_end(sim: Any, lay: Any, part: Any, dev: Device, r: int, dense_bytes: float,
                     expert_bytes: float) -> float:
    """When pipeline rank ``r``'s gradient reductions end: each chunk's (:func:`chunk_reduce_seconds`) at its
    last backward, one after another on one link, overlapping the rest."""
    dur = chunk_reduce_seconds(lay, part, dev, r, dense_bytes, expert_bytes)
    t_link = 0.0
    for c in sorted(sim.chunk_done[r], key=lambda c: sim.chunk_done[r][c]):
        t_link = max(t_link, sim.chunk_done[r][c]) + dur[c]
    return t_link


def small_collectives_s(lay: Any, dev: Device) -> float:
    """Per-step small collectives (a traced step at world 2: 5-6 all-reduces): loss-token counts, grad norm, loss
    sums, QB histograms (one batched call), QK-clip max, metrics; + the pp-group reductions of the metrics."""
    n = lay.pp * lay.dp * lay.cp
    lat_all, _ = group_link(range(n), dev)
    calls = 6 + (3 if lay.pp > 1 else 0)
    if n <= 1:
        return 0.0
    return calls * (dev.call_cost("all_reduce") + 2 * max(1, math.ceil(math.log2(max(2, n)))) * lat_all)
