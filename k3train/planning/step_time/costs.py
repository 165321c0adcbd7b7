"""Per-action costs of a layout: each virtual stage's forward and backward compute, their exposed in-action
communication, and the pipeline messages."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3train.planning.dtypes import dtype_bytes, train_dtype
from k3train.planning.memory.buffers import plan_bytes
from k3train.planning.step_time.comm import IN_ACTION_KINDS, comm_per_layer
from k3train.planning.step_time.compute import layer_compute, routed_share
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.links import group_link
from k3train.planning.step_time.overlap import layer_ops, own_row_share, side_timeline


@dataclass
class ActionCosts:
    f: list[float]          # per virtual stage: forward compute seconds per micro-batch
    b: list[float]
    f_comm: list[float]     # exposed in-action communication
    b_comm: list[float]
    msg_s: dict[int, tuple[float, float]]  # boundary -> (latency, transfer seconds) per message
    comm_kinds: list[dict[str, float]] = field(default_factory=list)  # per stage: f_comm + b_comm by kind


_MEMO: dict[tuple, Any] = {}


def layer_terms(cfg: Any, dev: Device, lay: Any, layer_times: Any, skew: float) -> tuple:
    """Memoised per-layer compute and communication of a layout's ``(mbs, cp, ep, moonep)``: ``(compute, (forward,
    backward) exposed in-action communication, exposed by kind, sent by kind)``. Sent: :func:`comm_per_layer`;
    exposed: what each layer's own thread blocks on when it runs alone (:func:`layer_ops` through
    :func:`side_timeline`: the dispatcher's transfers overlap its expert compute and each other; in line on a host
    whose ranks share its cores)."""
    key = (id(cfg.model), id(dev), id(layer_times), skew, lay.mbs, lay.cp, lay.ep, lay.moonep, cfg.train.seq_len,
           cfg.train.dtype, cfg.parallel.mla_cp_balance, cfg.parallel.expert_wgrad_split)
    if key not in _MEMO:
        p2p = None
        if layer_times is not None and lay.moonep and lay.ep > 1:  # what MoonEP's dispatcher issued when timed
            t = layer_times.layers(cfg, lay.mbs, cfg.train.seq_len // lay.cp, lay.ep, True)
            if "p2p_layers" in t:
                p2p = list(t["p2p_layers"]) + [t.get("p2p_head")]
        sent: list[dict[str, tuple[float, float]]] = []
        compute = layer_compute(cfg, dev, lay, layer_times, skew)
        cf, cb = comm_per_layer(cfg, dev, lay, skew, p2p, sent)
        exposed = []
        for j, kind in enumerate(sent):
            if "ep_all_to_all" not in kind:
                exposed.append(dict(kind))
                continue
            c = compute[1][min(j, len(compute[1]) - 1)]  # the MTP layer: the last layer's compute
            x, own = routed_share(cfg, lay, j, skew), own_row_share(lay, skew, kind)
            by = {}
            for d, sec in (("f", c[0]), ("b", c[1])):
                _, blocked = side_timeline(layer_ops(d, kind, x * sec, (1 - x) * sec, own,
                                                     cfg.parallel.expert_wgrad_split, dtype_bytes(cfg)),
                                           in_line=dev.shares_cores)
                by[d] = blocked
            exposed.append({k: (by["f"].get(k, 0.0), by["b"].get(k, 0.0)) for k in kind})
            cf[j] = sum(v[0] for v in exposed[j].values())
            cb[j] = sum(v[1] for v in exposed[j].values())
        _MEMO[key] = (compute, (cf, cb), exposed, sent,
                      (cfg.model, dev, layer_times))  # keep the id()s alive
    return _MEMO[key][:4]


def action_costs(cfg: Any, dev: Device, lay: Any, part: Any, plan: Any, layer_times: Any,
                 skew: float) -> ActionCosts:
    """Per virtual stage of ``part``: its forward and backward compute of one micro-batch (the embedding on the
    first, the head and the MTP layer on the last), their exposed in-action communication (under recompute the
    forward's again in the backward) and by kind; per pipeline boundary of ``plan``: a message's latency and
    transfer seconds over the link between the two ranks."""
    (emb, layers, head), (cf, cb), kinds, _ = layer_terms(cfg, dev, lay, layer_times, skew)
    n = part.num_stages
    f, b, fc, bc, ck = [], [], [], [], []
    for v in range(n):
        s, e = part.bounds[v]
        k = 2 if lay.recompute else 1  # the backward under recompute re-runs the forward (layer_compute)
        fv = sum(layers[i][0] for i in range(s, e)) + (emb[0] if v == 0 else 0) + (head[0] if v == n - 1 else 0)
        bv = sum(layers[i][k] for i in range(s, e)) + (emb[k] if v == 0 else 0) + (head[k] if v == n - 1 else 0)
        fcv, bcv = sum(cf[s:e]), sum(cb[s:e])
        mine = kinds[s:e] + (kinds[len(layers):] if v == n - 1 else [])
        if v == n - 1:  # the MTP layer's communication (comm_per_layer's extra entry)
            fcv, bcv = fcv + sum(cf[len(layers):]), bcv + sum(cb[len(layers):])
        if lay.recompute:
            bcv = bcv + fcv
        # per kind, forward + backward of the action pair (under recompute the forward's collectives twice)
        ck.append({k: sum((2 if lay.recompute else 1) * d[k][0] + d[k][1] for d in mine if k in d)
                   for k in IN_ACTION_KINDS})
        f.append(fv)
        b.append(bv)
        fc.append(fcv)
        bc.append(bcv)
    msg: dict[int, tuple[float, float]] = {}
    if plan is not None:
        dtype = train_dtype(cfg)
        T = cfg.train.seq_len // lay.cp
        stride = lay.dp * lay.cp
        for bd in range(n - 1):
            nbytes = plan_bytes(plan, bd, lay.mbs, T, cfg.model.hidden_size, dtype)
            src, dst = (bd % lay.pp) * stride, ((bd + 1) % lay.pp) * stride
            lat, bwid = group_link((src, dst), dev)
            msg[bd] = (lat + dev.call_cost("p2p"), nbytes / bwid)
    return ActionCosts(f=f, b=b, f_comm=fc, b_comm=bc, msg_s=msg, comm_kinds=ck)
