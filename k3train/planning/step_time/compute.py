"""Compute seconds per piece of the model (per layer, the embedding, the head): from FLOPs at the device's
achievable rate, or as measured on this host (``--device cpu``)."""
from __future__ import annotations

from typing import Any

from k3train.planning.step_time.device import Device
from parallel.pipeline.partition import embed_cost, head_cost, layer_cost


def anchor_of(layer_times: Any, cfg: Any) -> Any:
    """The :class:`~k3train.planning.calibration.layer_times.TrainerAnchor` of ``cfg`` on this host (cpu with a
    plan's config), or None."""
    return layer_times.anchor(cfg) if layer_times is not None and hasattr(layer_times, "anchor") else None


def layer_compute(cfg: Any, dev: Device, lay: Any, layer_times: Any, skew: float) -> tuple[list, list, list]:
    """Per piece forward/backward seconds: ``(embed [f, b, b_rc], layers [[f, b, b_rc]], head [f, b, b_rc])``,
    ``b_rc`` the backward under ``parallel.recompute`` (the forward re-run included: timed on ``cpu``, ``b + f``
    from the FLOPs otherwise)."""
    m = cfg.model
    B, Tfull = lay.mbs, cfg.train.seq_len
    T = Tfull // lay.cp
    N = B * T
    routed = 2.0 * m.num_experts_per_token * 3 * m.expert_hidden_size * m.moe_intermediate_size
    sk = 1.0 if (lay.moonep or lay.ep == 1) else skew
    if layer_times is not None:
        t = layer_times.layers(cfg, B, T, lay.ep, lay.moonep)
        a = anchor_of(layer_times, cfg)
        s = a.fb_scale if a is not None else 1.0  # the trainer's forward + backward over the isolated layers'
        layers = []
        for i, fb in enumerate(t["layers"]):
            x = s
            if m.is_moe_layer(i) and sk != 1.0:
                x = s * (1 + (sk - 1) * routed / layer_cost(m, i, T))
            layers.append([y * x for y in fb])
        return [y * s for y in t["embed"]], layers, [y * s for y in t["head"]]
    rate = dev.flops()
    s_eff = mla_context(cfg, lay.cp)
    layers = []
    for i in range(m.num_hidden_layers):
        c = layer_cost(m, i, s_eff if m.layer_kind(i) == "mla" else T)
        if m.is_moe_layer(i):
            c += routed * (sk - 1)
        layers.append([c * N / rate, 2 * c * N / rate, 3 * c * N / rate])
    e = embed_cost(m) * N / rate
    h = head_cost(m, s_eff) * N / rate
    return [e, 2 * e, 3 * e], layers, [h, 2 * h, 3 * h]


def mla_context(cfg: Any, cp: int) -> int:
    """The sequence length whose causal mean context the slowest CP rank's MLA queries see (``layer_cost``'s
    ``seq_len``): the row's under ``parallel.mla_cp_balance`` (every rank computes ``T_full^2 / 2cp`` query-key
    pairs, kcp/mla_cp.py), else ``2 T_full - T - 1`` (the last rank: mean context ``T_full - T/2``)."""
    t_full = cfg.train.seq_len
    if cp == 1 or cfg.parallel.mla_cp_balance:
        return t_full
    return 2 * t_full - t_full // cp - 1


def routed_share(cfg: Any, lay: Any, i: int, skew: float) -> float:
    """The routed experts' share of layer ``i``'s compute (their share of its FLOPs, ``partition.layer_cost``; the
    busiest rank's under plain EP; ``i`` past the backbone: the MTP layer, taken as the last layer's FFN kind)."""
    m = cfg.model
    L = m.num_hidden_layers
    routed = 2.0 * m.num_experts_per_token * 3 * m.expert_hidden_size * m.moe_intermediate_size * (
        1.0 if lay.moonep else skew)
    return min(1.0, routed / layer_cost(m, min(i, L - 1), cfg.train.seq_len // lay.cp))
