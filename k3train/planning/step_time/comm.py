"""In-action communication per layer: what EP, MoonEP, KCP and MLA-CP send per micro-batch (module docstring of
:mod:`k3train.planning.step_time`)."""
from __future__ import annotations

import math
from typing import Any

from k3train.model.chunking import head_ranges, token_ranges
from k3train.planning.dtypes import dtype_bytes
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.links import group_link, ring_time

# the in-action collectives by kind (comm_per_layer), and the rest of a step's communication (predict)
IN_ACTION_KINDS = ("ep_all_to_all", "moonep_replicas", "kcp", "mla_cp")


def comm_per_layer(cfg: Any, dev: Device, lay: Any, skew: float, p2p: list[list[int]] | None = None,
                   kinds: list[dict[str, float]] | None = None) -> tuple[list[float], list[float]]:
    """Per layer (forward, backward) exposed EP / KCP / MLA-CP seconds per micro-batch (:mod:`k3train.planning.step_time`); the
    list has one more entry than the backbone: the MTP layer (MLA attention + the last layer's FFN kind), which
    runs on the last stage. ``kinds``, if given, receives per layer ``{kind: (forward, backward) seconds}`` over
    :data:`IN_ACTION_KINDS` (the same terms, by collective). Call counts are the implementation's (checked against a traced step). ``p2p``: per
    layer (and the MTP layer last) ``[calls, bytes]`` of MoonEP's point-to-point in the forward, then in the
    backward, as its dispatcher issued them for one micro-batch (``--device cpu``: counted while the layers are
    timed, k3train/planning/calibration/layer_bench.py); without it the replica transfers come from the skew."""
    m = cfg.model
    B = lay.mbs
    L = m.num_hidden_layers
    layers = list(range(L)) + ([L - 1] if m.num_nextn_predict_layers else [])
    fw, bw = [], []
    for j, i in enumerate(layers):
        kind = "mla" if j == L else m.layer_kind(i)
        groups: list[tuple[str, list[tuple[float, float]]]] = []
        if lay.ep > 1 and m.is_moe_layer(i):
            groups += _ep_terms(cfg, dev, lay, skew, p2p, j)
        if lay.cp > 1:
            groups.append(_cp_terms(cfg, dev, lay, kind))
        f = b = 0.0
        by: dict[str, tuple[float, float]] = {}
        for k, terms in groups:
            for df, db in terms:
                f += df
                b += db
            # what f and b gained since the previous kind is kind k's
            by[k] = (f - sum(x[0] for x in by.values()), b - sum(x[1] for x in by.values()))
        fw.append(f)
        bw.append(b)
        if kinds is not None:
            kinds.append(by)
    if lay.cp > 1:  # kcp/context.py: the layout exchange of every micro-batch (shapes, document edges)
        ex = ring_time("all_gather", lay.cp * B * 64, range(lay.cp), dev, calls=2)
        fw[0] += ex
        if kinds is not None:
            kinds[0]["kcp"] = (kinds[0].get("kcp", (0.0, 0.0))[0] + ex, kinds[0].get("kcp", (0.0, 0.0))[1])
    return fw, bw


def _ep_terms(cfg: Any, dev: Device, lay: Any, skew: float, p2p: list[list[int]] | None,
              j: int) -> list[tuple[str, list[tuple[float, float]]]]:
    """A MoE layer's (forward, backward) seconds under EP, in the order they add up: the token all-to-alls and the
    routing-count all-gather, then MoonEP's replica transfers (as timed, ``p2p[j]``, else from the skew). ParallelDims'
    order: an EP group is ep consecutive ranks of one stage."""
    m = cfg.model
    es = dtype_bytes(cfg)
    N = lay.mbs * (cfg.train.seq_len // lay.cp)
    ep_ranks = range(lay.ep)
    rows = N * m.num_experts_per_token
    sk = 1.0 if lay.moonep else skew
    # moonep/dispatcher.py: forward = routing-count all-gather + dispatch + combine all-to-all; backward
    # = the two all-to-alls of the gradients; once per token chunk of the layer (model.moe_token_chunk)
    n_disp = len(token_ranges(N, m.moe_token_chunk))
    a2a = ring_time("all_to_all", 2 * rows * m.expert_hidden_size * es * sk, ep_ranks, dev,
                    calls=2 * n_disp)
    tokens = [(a2a + ring_time("all_gather", n_disp * lay.ep * m.num_experts * 4, ep_ranks, dev, calls=n_disp), a2a)]
    replicas: list[tuple[float, float]] = []
    if lay.moonep and p2p is not None and p2p[j] is not None:
        fc, fbytes, bc, bbytes = p2p[j]
        lat, bwid = group_link(ep_ranks, dev)
        replicas.append((fc * (dev.call_cost("p2p") + lat) + fbytes / bwid,
                         bc * (dev.call_cost("p2p") + lat) + bbytes / bwid))
    elif lay.moonep:
        n_loc = m.num_experts // lay.ep
        red = min(n_loc, math.ceil(max(0.0, skew - 1.0) * n_loc))
        w = 3 * m.expert_hidden_size * m.moe_intermediate_size
        lat, bwid = group_link(ep_ranks, dev)
        if red:  # the shared replica pool: fetched in forward, fetched again + fp32 grads reduced back
            replicas.append((dev.call_cost("p2p") + lat + red * w * es / bwid,
                             2 * (dev.call_cost("p2p") + lat) + red * w * (es + 4) / bwid))
    return [("ep_all_to_all", tokens), ("moonep_replicas", replicas)]


def _cp_terms(cfg: Any, dev: Device, lay: Any, kind: str) -> tuple[str, list[tuple[float, float]]]:
    """A layer's (forward, backward) seconds under CP: KCP's for a KDA layer, MLA-CP's for an MLA one. ParallelDims'
    order: a CP group is cp consecutive ranks."""
    m = cfg.model
    es = dtype_bytes(cfg)
    B, T = lay.mbs, cfg.train.seq_len // lay.cp
    cp_ranks = range(lay.cp)
    if kind == "kda":
        # kcp/halo.py: the short convolutions' halo (all-gather forward, reduce-scatter backward);
        # kcp/kda_cp.py: the (M, S~) pairs all-gathered forward, their gradients all-gathered backward
        # (once per head chunk of the layer: model.mixer_head_chunk, the same bytes in all)
        hc = len(head_ranges(m.kda_num_heads, m.mixer_head_chunk))
        pairs = lay.cp * B * m.kda_num_heads * m.kda_head_dim * (2 * m.kda_head_dim) * 4
        halo = lay.cp * B * (m.short_conv_kernel_size - 1) * 3 * m.kda_num_heads * m.kda_head_dim * es
        return "kcp", [((ring_time("all_gather", pairs, cp_ranks, dev, calls=hc)
                         + ring_time("all_gather", halo, cp_ranks, dev, calls=hc)),
                        (ring_time("all_gather", pairs, cp_ranks, dev, calls=hc)
                         + ring_time("reduce_scatter", halo, cp_ranks, dev, calls=hc)))]
    lat_b = B * T * lay.cp * (m.kv_lora_rank + m.qk_rope_head_dim) * es
    terms = [(ring_time("all_gather", lat_b, cp_ranks, dev), ring_time("reduce_scatter", lat_b, cp_ranks, dev))]
    if cfg.parallel.mla_cp_balance:  # kcp/mla_cp.py: x out / y back forward, dy / dx backward
        lat, bwid = group_link(cp_ranks, dev)
        swap = dev.call_cost("all_to_all") + lat + B * (T - T // 2) * m.hidden_size * es / bwid
        terms.append((2 * swap, 2 * swap))
    return "mla_cp", terms
