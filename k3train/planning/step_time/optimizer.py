"""The optimizer step's seconds per pipeline stage (its worst rank's owned share)."""
from __future__ import annotations

from typing import Any

from k3train.optim.newton_schulz import ns_flops
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.facts import ParamFacts, opt_sig
from moonep.shard import is_expert_param

_MEMO: dict[tuple, Any] = {}


def optimizer_seconds(facts: ParamFacts, cfg: Any, dev: Device, part: Any, r: int, lay: Any,
                      opt_times: dict[str, float] | None) -> float:
    """The worst rank of pipeline stage ``r``: its owned share (at least the largest parameter) of the update."""
    key = ("opt", id(facts), id(dev), id(opt_times))
    if key not in _MEMO:
        _MEMO[key] = (_opt_pieces(facts, cfg, dev, opt_times), (facts, dev, opt_times))
    per = _MEMO[key][0]
    dpcp, edp = lay.dp * lay.cp, max(1, lay.dp * lay.cp // lay.ep)
    dense = expert = biggest = 0.0
    for k in facts.stage_keys(part, r):
        d_s, e_s, big = per.get(k, (0.0, 0.0, 0.0))
        dense, expert, biggest = dense + d_s, expert + e_s / lay.ep, max(biggest, big)
    if lay.zero == 0:
        return dense + expert
    return max(dense / dpcp, biggest) + expert / edp


def _opt_pieces(facts: ParamFacts, cfg: Any, dev: Device, opt_times: dict[str, float] | None) -> dict:
    """Per piece: ``(dense update seconds, routed-expert seconds of the whole stack, largest dense update)``;
    measured per parameter on cpu (expert shards: 1/ep of the stack's time), else Newton-Schulz FLOPs at the
    achievable FLOP/s + ~7 fp32 accesses per element (param, grad, state(s) read and written) at HBM speed."""
    out: dict[Any, list[float]] = {}
    for inf in facts.infos:
        ex = is_expert_param(inf.param)
        if opt_times is not None:
            s = opt_times[opt_sig(inf)]
        else:
            ns = sum(ns_flops(sh, cfg.optim.ns_steps) for sh in inf.ns_shapes())
            s = ns / dev.flops() + inf.numel * 4 * 7 / (dev.hbm_bw * dev.hbm_eff)
        p = out.setdefault(facts.piece_of[inf.fqn], [0.0, 0.0, 0.0])
        if ex:
            p[1] += s
        else:
            p[0] += s
            p[2] = max(p[2], s)
    return {k: tuple(v) for k, v in out.items()}
