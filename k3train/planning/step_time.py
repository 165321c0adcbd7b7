"""Predicted step time of one layout: per-action costs, the real per-rank pipeline programs simulated, then the
data-parallel reductions and the optimizer.

Per virtual stage and micro-batch (``B = micro_batch_size`` rows of ``T = seq_len / cp`` tokens):

* compute: GPUs -- forward FLOPs of each layer from the project's partitioner cost model
  (``parallel.pipeline.partition.layer_cost / embed_cost / head_cost``: KDA, MLA, dense FFN, LatentMoE, AttnRes,
  LM head + MTP) x ``B*T`` at the device's achievable FLOP/s, backward = 2 x forward; the MLA attention term is taken
  at the slowest context-parallel rank's mean context: ``T_full / 2`` on every rank under ``parallel.mla_cp_balance``
  (kcp/mla_cp.py), else the LAST rank's ``T_full - T/2``. ``--device cpu`` --
  measured per-layer times (:mod:`k3train.planning.layer_bench`). Full recomputation adds the forward to the
  backward. Plain EP (no MoonEP) multiplies the routed-expert share of a MoE layer by the routing skew (the most
  loaded EP rank's load over the mean; ``--ep-skew``, default 1.5 -- about what QB leaves early in training, see
  ``moe_maxvio`` in metrics.jsonl); MoonEP computes exactly ``N*k`` rows on every rank (skew 1).
* in-action communication: EP -- per MoE layer two all-to-alls forward (dispatch, combine) and two backward of
  ``N*k`` latent rows, the ``(ep-1)/ep`` that leave the rank (x skew on the busiest receiver without MoonEP); MoonEP
  adds the redundant experts' weight prefetch and their fp32 gradient reduce-back: on ``cpu`` the point-to-point
  calls and bytes its dispatcher issued while the layers were timed (each call a ``Device.call_cost('p2p')``), on
  GPUs ``min(E/ep, ceil((skew-1) E/ep))`` experts of ``3 l f`` each; all of it exposed (the runtime issues it in
  line). KCP -- per KDA layer one all-gather of the ``B x H x dk x (dk+dv)`` fp32 pairs forward and one backward;
  MLA-CP -- per MLA layer an all-gather of the ``B x T x (kv_lora_rank + rope)`` latents forward and a
  reduce-scatter backward, and under the causal balance two half-segment swaps each way (the layer's input and
  output, ``B x T/2 x d`` with the partner rank ``cp-1-r``, the CP group's link); KCP's short-convolution halo
  and per-micro-batch layout exchange; the MTP layer's on the last stage. Ring formulas (``(n-1)`` latency
  steps, ``(n-1)/n x bytes`` per rank) on the link the group spans, plus ``Device.call_cost(kind)`` per call
  (cpu: what a small all-reduce costs while every rank of the host computes, ``devices.bench_loaded_collective``:
  with more ranks than cores a collective waits for descheduled peers; GPUs: 0).
* p2p: the cached AttnRes plan's payload per boundary (``memory.plan_bytes``) over the link between the two ranks.

The schedule: :func:`parallel.pipeline.p2p.build_programs` gives every pipeline rank's real program (receives
posted, computes, sends); :func:`simulate_programs` executes those programs event by event -- a compute starts
when its inputs have arrived, a send occupies its link -- so the bubble is the real schedule's. On a CPU the ranks
of the host share its cores: while ``n`` ranks compute (every busy pipeline rank times its dp x cp replicas), each
runs at ``Device.rank_speed(n)`` -- measured on this host (``devices.bench_concurrency``; ``tools/plan.py`` takes
the curve of n copies of this config's real one-process trainer stepping at once, ``anchor.concurrency_curve``),
which is below plain processor sharing ``min(1, cores / n)``: ranks also compete for caches and memory bandwidth,
and past the core count the scheduler's switching costs more. An action's in-action communication follows its
compute at wall speed (its per-call costs were measured while every rank computes) and the rank waiting in it does
not count among those computing.

After the pipeline: gradients (parameter dtype) all-reduced over ``dp_cp`` (dense) and ``edp`` (routed experts) at
ZeRO 0/1; at ZeRO-2 reduced to owners per chunk as soon as the chunk's last backward ends (overlapping the rest of
the pipeline); the optimizer (Muon Newton-Schulz FLOPs + elementwise bytes; on cpu measured per parameter),
balanced over owners at ZeRO >= 1 (not below the largest parameter); ZeRO >= 1 then broadcasts the updated
parameters (all-gather bytes). ``--device cpu``: the trainer anchor (:class:`~k3train.planning.layer_bench.
TrainerAnchor`, one real one-process run of the config on this host) scales the measured layer and optimizer
times to what the trainer takes, and adds the gradient norm's own work (the rank's share of the parameters) and the
step's host work outside the timed phases (``Prediction.host``). Ranks are placed in ``ParallelDims``' order, ``gpus_per_node`` per node; a group
whose ranks share a node uses NVLink, else the inter-node link.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from k3train.planning.devices import Device


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


# --------------------------------------------------------------------------------------------------------------
# static per-config facts: parameters per layer (from the meta-device model)
# --------------------------------------------------------------------------------------------------------------
@dataclass
class ParamFacts:
    """Per piece (``'embed'``, layer index, ``'head'``): ``(dense numel, expert numel, muon NS FLOPs dense,
    expert NS FLOPs, largest dense numel)`` and the ``ParamInfo`` list (cpu optimizer timing)."""
    pieces: dict[Any, list[float]]
    infos: list[Any]
    piece_of: dict[str, Any]

    @classmethod
    def build(cls, cfg: Any) -> "ParamFacts":
        import torch

        from k3train.model.model import K3Model
        from k3train.optim.newton_schulz import ns_flops
        from k3train.optim.param_groups import build_param_infos
        from moonep.shard import is_expert_param, mark_expert_params

        with torch.device("meta"):
            m = K3Model(cfg.model, cfg.vision)
        mark_expert_params(m)
        infos = build_param_infos([m], cfg.optim)
        pieces: dict[Any, list[float]] = {}
        piece_of = {}
        for inf in infos:
            head = inf.fqn.split(".")
            # the vision tower lives with the embedding on the first stage (its own key: the last stage's MTP
            # copy of the shared embedding holds embed_tokens only)
            key: Any = int(head[1]) if head[0] == "layers" else (
                "embed" if head[0] == "embed_tokens" else "vision" if head[0] == "vision" else "head")
            piece_of[inf.fqn] = key
            p = pieces.setdefault(key, [0.0, 0.0, 0.0, 0.0, 0.0])
            ex = is_expert_param(inf.param)
            ns = sum(ns_flops(s, cfg.optim.ns_steps) for s in inf.ns_shapes())
            p[1 if ex else 0] += inf.numel
            p[3 if ex else 2] += ns
            if not ex:
                p[4] = max(p[4], inf.numel)
        return cls(pieces=pieces, infos=infos, piece_of=piece_of)

    def stage_keys(self, part: Any, pp_rank: int) -> list[Any]:
        keys: list[Any] = []
        for v in part.local_stages(pp_rank):
            s, e = part.bounds[v]
            keys += list(range(s, e))
            if v == 0:
                keys += ["embed", "vision"]
            if v == part.num_stages - 1:
                keys.append("head")
                if part.pp > 1 and "embed" not in keys:
                    keys.append("embed")  # the MTP's copy of the shared embedding (stage.shares_embedding)
        return keys

    def chunk_numel(self, part: Any, v: int, ep: int) -> float:
        """Parameters (experts: this rank's 1/ep) of virtual stage ``v``."""
        s, e = part.bounds[v]
        keys: list[Any] = list(range(s, e)) + (["embed", "vision"] if v == 0 else [])
        if v == part.num_stages - 1:
            keys += ["head"] + (["embed"] if part.pp > 1 and v != 0 else [])
        return sum(self.pieces.get(k, [0.0] * 5)[0] + self.pieces.get(k, [0.0] * 5)[1] / ep for k in keys)

    def stage_numel(self, part: Any, pp_rank: int, ep: int) -> tuple[float, float, float]:
        """``(dense, expert on this rank, largest dense parameter)``."""
        d = e = big = 0.0
        for k in self.stage_keys(part, pp_rank):
            p = self.pieces.get(k, [0.0] * 5)
            d, e, big = d + p[0], e + p[1] / ep, max(big, p[4])
        return d, e, big


def forwards_before_first_backward(schedule: str, pp: int, vpp: int, num_microbatches: int) -> list[list[int]]:
    """Per pipeline rank, the local chunks of the forwards it runs before its first backward, then that backward's
    chunk last: the prefix of :func:`parallel.pipeline.schedules.build_schedule`'s action list up to the first
    backward (``schedule`` 'none': one rank, one forward). Only that prefix is built (the planner asks for
    thousands of (pp, vpp, micro-batches))."""
    from parallel.pipeline.schedules import interleaved_prefix

    M = num_microbatches
    if pp == 1 or schedule == "none":
        return [[0, 0]]
    if schedule == "afab":
        return [[c for c in range(vpp) for _ in range(M)] + [vpp - 1]] * pp
    if schedule == "1f1b":
        return [[0] * min(pp - r, M) + [0] for r in range(pp)]
    return [interleaved_prefix(pp, vpp, r, M) for r in range(pp)]


def _stage_terms(facts: ParamFacts, part: Any, ep: int) -> list[tuple[float, float, float, list]]:
    """Per pipeline rank: ``(dense numel, expert numel on the rank, the largest local chunk's numel, the local
    chunks' layer ranges)`` -- what :func:`static_memory_lower_bound` reads of the partition (memoised: the planner
    bounds hundreds of thousands of layouts over a few hundred partitions)."""
    key = ("stage_terms", id(facts), id(part), ep)
    if key not in _MEMO:
        terms = []
        for r in range(part.pp):
            d, e, _ = facts.stage_numel(part, r, ep)
            chunk = max((facts.chunk_numel(part, v, ep) for v in part.local_stages(r)), default=0.0)
            terms.append((d, e, chunk, [tuple(x) for x in part.local_chunks(r)]))
        _MEMO[key] = (terms, facts, part)  # the objects kept alive: their ids stay theirs
    return _MEMO[key][0]


def _flight_counts(flight: list[int]) -> tuple[dict[int, int], int]:
    """``({local chunk: forwards in flight}, chunk of the first backward)`` of one rank's
    :func:`forwards_before_first_backward` list (memoised by the list object)."""
    key = ("flight", id(flight))
    if key not in _MEMO:
        counts: dict[int, int] = {}
        for c in flight[:-1]:
            counts[c] = counts.get(c, 0) + 1
        _MEMO[key] = ((counts, flight[-1]), flight)
    return _MEMO[key][0]


def static_memory_lower_bound(facts: ParamFacts, cfg: Any, part: Any, pp: int, dpcp: int, ep: int,
                              zero: int, moonep: bool = False, tokens: int = 0, recompute: str | None = None,
                              in_flight: list[list[int]] | None = None,
                              ffn_saved: dict[bool, int] | None = None) -> int:
    """A lower bound on the worst rank's peak from parameters, gradients and optimizer state alone (the memory
    estimator's byte rules: parameter-dtype weights and gradients, fp32 master copies of non-fp32 weights, Muon 1
    / AdamW 2 fp32 states -- counted as Muon for all, a lower bound; owners' shares at least the mean). At ZeRO-2
    a chunk's gradients are whole from its first backward until they are reduce-scattered after its last one: the
    largest local chunk's full gradients are counted on top of the shards. With MoonEP, the replica pool's two
    banks of one MoE layer's local experts (``E / ep`` of them) are always allocated.

    ``tokens`` (a micro-batch's tokens on a rank, ``micro_batch_size x seq_len / cp``): every sublayer (token mixer,
    FFN) makes a new ``[tokens, d]`` partial sum -- a source of the later layers' AttnRes aggregations, or the
    standard residual stream -- that lives from its forward to its backward, recomputation or not
    (tests/model/test_chunked_recompute.py: ``sublayer`` keeps about one hidden state per sublayer); without
    recomputation (``recompute`` None) also each sublayer's normalised input, which its projections save (tiny,
    measured: 46 hidden states per layer; ``sublayer`` 4.5, ``layer`` 1.2); under ``layer`` only each layer's
    output stays (the mixer's partial sum is remade in the backward),
    under ``chunk`` only the chunk's input, and the recomputed chunk's sublayers in its backward. ``in_flight``
    (:func:`forwards_before_first_backward`): the forwards the schedule runs before a rank's first backward each
    keep theirs; without it one forward of every local chunk. With the weights and optimizer state (no gradients:
    those of the chunk may still be forming) that is a bound too, and at long context the one that rules layouts
    out (a 1M row over few pipeline stages, or many micro-batches in flight).

    ``ffn_saved`` (``recompute`` ``"sublayer"`` or None, a micro-batch the estimator composes per piece:
    :func:`k3train.planning.memory.ffn_saved_bytes`, ``{is_moe: bytes}``, traced under the same recompute setting):
    each FFN counts what its traced sublayer keeps -- under sublayer recomputation the very bytes the estimator
    composes for it; without recomputation a part of its layer's (the same FFN ops on the same shapes, the mixer's
    output their input) -- the same for every cp, instead of one or two hidden states; the token mixer counts one
    (its partial sum)."""
    from k3train.planning.memory import _layer_is_moe

    es = 2 if cfg.train.dtype == "bfloat16" else 4
    master = 4 if es != 4 else 0
    edp = max(1, dpcp // ep)
    pool = 0.0
    if moonep and ep > 1:
        pool = 2 * max((v[1] for v in facts.pieces.values()), default=0.0) / ep * es
    best = 0.0
    h = tokens * cfg.model.hidden_size * es
    for r, (d, e, chunk, chunks) in enumerate(_stage_terms(facts, part, ep)):
        n = d + e
        if zero < 2:
            grads = n * es
        else:
            grads = (d / dpcp + e / edp) * es + chunk * es * (1 - 1 / edp)  # the chunk's own shard counted once
        opt = n * (4 + master)
        if zero >= 1:
            opt = (d / dpcp + e / edp) * (4 + master)
        if in_flight is not None:
            fwd, first_b = _flight_counts(in_flight[r])
        else:
            fwd, first_b = {c: 1 for c in range(len(chunks))}, len(chunks) - 1
        if recompute == "chunk":
            act = (sum(fwd.values()) - 1 + 2 * (chunks[first_b][1] - chunks[first_b][0])) * h
        elif recompute in ("sublayer", None) and ffn_saved is not None:
            act = sum(k * sum(h + ffn_saved[_layer_is_moe(cfg, i)] for i in range(*chunks[c])) for c, k in fwd.items())
        else:
            hidden = {"layer": 1, "sublayer": 2}.get(recompute, 4)
            act = hidden * sum(k * (chunks[c][1] - chunks[c][0]) for c, k in fwd.items()) * h
        best = max(best, n * es + grads + opt + pool, n * es + opt + pool + act)
    return int(best)


# --------------------------------------------------------------------------------------------------------------
# collectives and links
# --------------------------------------------------------------------------------------------------------------
def node_of(rank: int, dev: Device) -> int:
    return rank // max(1, dev.gpus_per_node)


def group_link(ranks: Any, dev: Device) -> tuple[float, float]:
    """The link of a group given as an increasing rank sequence: inside a node iff its first and last rank are."""
    return dev.link(node_of(ranks[0], dev) == node_of(ranks[-1], dev))


def ring_time(kind: str, nbytes: float, ranks: Any, dev: Device, calls: int = 1) -> float:
    """``kind``: 'all_reduce' | 'all_gather' | 'reduce_scatter' | 'all_to_all' (``nbytes``: the full buffer of one
    rank; all-gather: the gathered result), issued as ``calls`` collective calls (each pays ``dev.call_cost(kind)``)."""
    n = len(ranks)
    if n <= 1 or calls <= 0:
        return 0.0
    lat, bw = group_link(ranks, dev)
    fixed = calls * dev.call_cost(kind)
    if kind == "all_reduce":
        return fixed + calls * 2 * (n - 1) * lat + 2 * (n - 1) / n * max(0.0, nbytes) / bw
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return fixed + calls * (n - 1) * lat + (n - 1) / n * max(0.0, nbytes) / bw
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------------------------
# per-action costs
# --------------------------------------------------------------------------------------------------------------
@dataclass
class ActionCosts:
    f: list[float]          # per virtual stage: forward compute seconds per micro-batch
    b: list[float]
    f_comm: list[float]     # exposed in-action communication
    b_comm: list[float]
    msg_s: dict[int, tuple[float, float]]  # boundary -> (latency, transfer seconds) per message


def anchor_of(layer_times: Any, cfg: Any) -> Any:
    """The :class:`~k3train.planning.layer_bench.TrainerAnchor` of ``cfg`` on this host (cpu with a plan's config),
    or None."""
    return layer_times.anchor(cfg) if layer_times is not None and hasattr(layer_times, "anchor") else None


def layer_compute(cfg: Any, dev: Device, lay: Any, layer_times: Any, skew: float) -> tuple[list, list, list]:
    """Per piece forward/backward seconds: ``(embed [f, b, b_rc], layers [[f, b, b_rc]], head [f, b, b_rc])``,
    ``b_rc`` the backward under ``parallel.recompute`` (the forward re-run included: timed on ``cpu``, ``b + f``
    from the FLOPs otherwise)."""
    from parallel.pipeline.partition import embed_cost, head_cost, layer_cost

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


def comm_per_layer(cfg: Any, dev: Device, lay: Any, skew: float,
                   p2p: list[list[int]] | None = None) -> tuple[list[float], list[float]]:
    """Per layer (forward, backward) exposed EP / KCP / MLA-CP seconds per micro-batch (module docstring); the
    list has one more entry than the backbone: the MTP layer (MLA attention + the last layer's FFN kind), which
    runs on the last stage. Call counts are the implementation's (checked against a traced step). ``p2p``: per
    layer (and the MTP layer last) ``[calls, bytes]`` of MoonEP's point-to-point in the forward, then in the
    backward, as its dispatcher issued them for one micro-batch (``--device cpu``: counted while the layers are
    timed, k3train/planning/layer_bench.py); without it the replica transfers come from the skew."""
    from k3train.model.chunking import head_ranges, token_ranges
    m = cfg.model
    es = 2 if cfg.train.dtype == "bfloat16" else 4
    B, T = lay.mbs, cfg.train.seq_len // lay.cp
    N = B * T
    # ParallelDims' order: an EP group is ep consecutive ranks of one stage, a CP group cp consecutive ranks
    ep_ranks, cp_ranks = range(lay.ep), range(lay.cp)
    L = m.num_hidden_layers
    layers = list(range(L)) + ([L - 1] if m.num_nextn_predict_layers else [])
    fw, bw = [], []
    for j, i in enumerate(layers):
        kind = "mla" if j == L else m.layer_kind(i)
        f = b = 0.0
        if lay.ep > 1 and m.is_moe_layer(i):
            rows = N * m.num_experts_per_token
            sk = 1.0 if lay.moonep else skew
            # moonep/dispatcher.py: forward = routing-count all-gather + dispatch + combine all-to-all; backward
            # = the two all-to-alls of the gradients; once per token chunk of the layer (model.moe_token_chunk)
            n_disp = len(token_ranges(N, m.moe_token_chunk))
            a2a = ring_time("all_to_all", 2 * rows * m.expert_hidden_size * es * sk, ep_ranks, dev,
                            calls=2 * n_disp)
            f += a2a + ring_time("all_gather", n_disp * lay.ep * m.num_experts * 4, ep_ranks, dev, calls=n_disp)
            b += a2a
            if lay.moonep and p2p is not None and p2p[j] is not None:
                fc, fbytes, bc, bbytes = p2p[j]
                lat, bwid = group_link(ep_ranks, dev)
                f += fc * (dev.call_cost("p2p") + lat) + fbytes / bwid
                b += bc * (dev.call_cost("p2p") + lat) + bbytes / bwid
            elif lay.moonep:
                n_loc = m.num_experts // lay.ep
                red = min(n_loc, math.ceil(max(0.0, skew - 1.0) * n_loc))
                w = 3 * m.expert_hidden_size * m.moe_intermediate_size
                lat, bwid = group_link(ep_ranks, dev)
                if red:  # the shared replica pool: fetched in forward, fetched again + fp32 grads reduced back
                    f += dev.call_cost("p2p") + lat + red * w * es / bwid
                    b += 2 * (dev.call_cost("p2p") + lat) + red * w * (es + 4) / bwid
        if lay.cp > 1:
            if kind == "kda":
                # kcp/halo.py: the short convolutions' halo (all-gather forward, reduce-scatter backward);
                # kcp/kda_cp.py: the (M, S~) pairs all-gathered forward, their gradients all-gathered backward
                # (once per head chunk of the layer: model.mixer_head_chunk, the same bytes in all)
                hc = len(head_ranges(m.kda_num_heads, m.mixer_head_chunk))
                pairs = lay.cp * B * m.kda_num_heads * m.kda_head_dim * (2 * m.kda_head_dim) * 4
                halo = lay.cp * B * (m.short_conv_kernel_size - 1) * 3 * m.kda_num_heads * m.kda_head_dim * es
                f += (ring_time("all_gather", pairs, cp_ranks, dev, calls=hc)
                      + ring_time("all_gather", halo, cp_ranks, dev, calls=hc))
                b += (ring_time("all_gather", pairs, cp_ranks, dev, calls=hc)
                      + ring_time("reduce_scatter", halo, cp_ranks, dev, calls=hc))
            else:
                lat_b = B * T * lay.cp * (m.kv_lora_rank + m.qk_rope_head_dim) * es
                f += ring_time("all_gather", lat_b, cp_ranks, dev)
                b += ring_time("reduce_scatter", lat_b, cp_ranks, dev)
                if cfg.parallel.mla_cp_balance:  # kcp/mla_cp.py: x out / y back forward, dy / dx backward
                    lat, bwid = group_link(cp_ranks, dev)
                    swap = dev.call_cost("all_to_all") + lat + B * (T - T // 2) * m.hidden_size * es / bwid
                    f += 2 * swap
                    b += 2 * swap
        fw.append(f)
        bw.append(b)
    if lay.cp > 1:  # kcp/context.py: the layout exchange of every micro-batch (shapes, document edges)
        fw[0] += ring_time("all_gather", lay.cp * B * 64, cp_ranks, dev, calls=2)
    return fw, bw


_MEMO: dict[tuple, Any] = {}


def _layer_terms(cfg: Any, dev: Device, lay: Any, layer_times: Any, skew: float) -> tuple:
    """Memoised per-layer compute and communication of a layout's ``(mbs, cp, ep, moonep)``."""
    key = (id(cfg.model), id(dev), id(layer_times), skew, lay.mbs, lay.cp, lay.ep, lay.moonep, cfg.train.seq_len,
           cfg.train.dtype, cfg.parallel.mla_cp_balance)
    if key not in _MEMO:
        p2p = None
        if layer_times is not None and lay.moonep and lay.ep > 1:  # what MoonEP's dispatcher issued when timed
            t = layer_times.layers(cfg, lay.mbs, cfg.train.seq_len // lay.cp, lay.ep, True)
            if "p2p_layers" in t:
                p2p = list(t["p2p_layers"]) + [t.get("p2p_head")]
        _MEMO[key] = (layer_compute(cfg, dev, lay, layer_times, skew), comm_per_layer(cfg, dev, lay, skew, p2p),
                      (cfg.model, dev, layer_times))  # keep the id()s alive
    return _MEMO[key][:2]


def action_costs(cfg: Any, dev: Device, lay: Any, part: Any, plan: Any, layer_times: Any,
                 skew: float) -> ActionCosts:
    import torch

    from k3train.planning.memory import plan_bytes

    (emb, layers, head), (cf, cb) = _layer_terms(cfg, dev, lay, layer_times, skew)
    n = part.num_stages
    f, b, fc, bc = [], [], [], []
    for v in range(n):
        s, e = part.bounds[v]
        k = 2 if lay.recompute else 1  # the backward under recompute re-runs the forward (layer_compute)
        fv = sum(layers[i][0] for i in range(s, e)) + (emb[0] if v == 0 else 0) + (head[0] if v == n - 1 else 0)
        bv = sum(layers[i][k] for i in range(s, e)) + (emb[k] if v == 0 else 0) + (head[k] if v == n - 1 else 0)
        fcv, bcv = sum(cf[s:e]), sum(cb[s:e])
        if v == n - 1:  # the MTP layer's communication (comm_per_layer's extra entry)
            fcv, bcv = fcv + sum(cf[len(layers):]), bcv + sum(cb[len(layers):])
        if lay.recompute:
            bcv = bcv + fcv
        f.append(fv)
        b.append(bv)
        fc.append(fcv)
        bc.append(bcv)
    msg: dict[int, tuple[float, float]] = {}
    if plan is not None:
        dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
        T = cfg.train.seq_len // lay.cp
        stride = lay.dp * lay.cp
        for bd in range(n - 1):
            nbytes = plan_bytes(plan, bd, lay.mbs, T, cfg.model.hidden_size, dtype)
            src, dst = (bd % lay.pp) * stride, ((bd + 1) % lay.pp) * stride
            lat, bwid = dev.link(node_of(src, dev) == node_of(dst, dev))
            msg[bd] = (lat + dev.call_cost("p2p"), nbytes / bwid)
    return ActionCosts(f=f, b=b, f_comm=fc, b_comm=bc, msg_s=msg)


# --------------------------------------------------------------------------------------------------------------
# the schedule: execute the real programs
# --------------------------------------------------------------------------------------------------------------
@dataclass
class SimOut:
    makespan: float
    end: list[float]                     # per rank: its last compute's end
    busy_compute: list[float]            # elapsed seconds computing
    busy_comm: list[float]               # elapsed seconds in in-action communication
    chunk_done: list[dict[int, float]]   # per rank: chunk -> end of its last backward


_PRE: dict[int, tuple[Any, list]] = {}


def _precompiled(programs: list[list[Any]], pp: int, vpp: int) -> list[list[tuple]]:
    """Per rank, the program as ``('recv',) | ('send', msg, dst) | ('comp', action, virtual stage, deps)``
    (memoised per programs object: the planner reuses one per schedule, pp, vpp and micro-batch count)."""
    from parallel.pipeline.schedules import deps_of

    key = id(programs)
    if key not in _PRE or _PRE[key][0] is not programs:
        out = []
        for r, prog in enumerate(programs):
            rows: list[tuple] = []
            for ins in prog:
                if ins.op == "recv":
                    rows.append(("recv",))
                elif ins.op == "send":
                    m = ins.msg
                    rows.append(("send", m, (m.stage + 1) % pp if m.kind == "act" else m.stage % pp))
                else:
                    a = ins.action
                    rows.append(("comp", a, a.chunk * pp + r, tuple(deps_of(a, r, pp, vpp))))
            out.append(rows)
        _PRE[key] = (programs, out)
    return _PRE[key][1]


def simulate_programs(programs: list[list[Any]], pp: int, vpp: int, costs: ActionCosts, replicas: int,
                      speed: Callable[[int], float] | None = None) -> SimOut:
    """Event-driven run of every pipeline rank's program (module docstring). ``replicas``: ranks doing the same
    work at the same time (dp x cp); ``speed(n)``: a rank's speed (1 = alone) while ``n`` ranks of the host
    compute (:meth:`Device.rank_speed`; None: a device each)."""
    progs = _precompiled(programs, pp, vpp)
    inf = float("inf")
    pos = [0] * pp
    arrival: dict[Any, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    rem = [0.0] * pp          # remaining compute of the running action (seconds at full speed)
    rem_comm = [0.0] * pp     # then its in-action communication (wall seconds: measured while every rank computes)
    running: list[Any] = [None] * pp
    wait: list[tuple] = [()] * pp  # deps of the compute a rank is blocked on
    t = 0.0
    end = [0.0] * pp
    bc, bm = [0.0] * pp, [0.0] * pp
    chunk_done: list[dict[int, float]] = [{} for _ in range(pp)]
    done = [False] * pp

    def advance(r: int) -> None:
        prog = progs[r]
        wait[r] = ()
        while pos[r] < len(prog):
            ins = prog[pos[r]]
            if ins[0] == "recv":
                pos[r] += 1
            elif ins[0] == "send":
                msg, dst = ins[1], ins[2]
                lat, xfer = costs.msg_s.get(msg.stage, (0.0, 0.0))
                k = (r, dst)
                start = max(t, link_free.get(k, 0.0))
                link_free[k] = start + xfer
                arrival[msg] = start + xfer + lat
                pos[r] += 1
            else:
                a, v, deps = ins[1], ins[2], ins[3]
                if any(arrival.get(d, inf) > t + 1e-15 for d in deps):
                    wait[r] = deps
                    return
                comp, comm = (costs.f[v], costs.f_comm[v]) if a.kind == "F" else (costs.b[v], costs.b_comm[v])
                rem[r], rem_comm[r] = comp, comm
                running[r] = a
                pos[r] += 1
                return
        done[r] = True

    def settle() -> None:
        """Advance every idle rank until none moves (a send may unblock a rank checked before it)."""
        moved = True
        while moved:
            moved = False
            for r in range(pp):
                if not done[r] and running[r] is None:
                    before = pos[r]
                    advance(r)
                    moved = moved or pos[r] != before or done[r]

    settle()
    while not all(done):
        # a rank computes, then waits in its action's collectives (asleep: it leaves the cores to the others)
        busy = [r for r in range(pp) if running[r] is not None]
        computing = [r for r in busy if rem[r] > 0.0]
        rate = speed(len(computing) * replicas) if speed is not None and computing else 1.0
        t_next = min((t + (rem[r] / rate if rem[r] > 0.0 else rem_comm[r]) for r in busy), default=inf)
        for r in range(pp):
            if wait[r]:
                w = max(arrival.get(d, inf) for d in wait[r])
                if t < w < t_next:
                    t_next = w
        if t_next == inf:
            raise RuntimeError("pipeline programs deadlock in the simulation")
        dt = t_next - t
        for r in busy:
            if rem[r] > 0.0:
                rem[r] -= dt * rate
                bc[r] += dt
                if rem[r] <= 1e-12 * max(1.0, t_next):
                    rem[r] = 0.0
            else:
                rem_comm[r] -= dt
                bm[r] += dt
        t = t_next
        for r in busy:
            if rem[r] <= 0.0 and rem_comm[r] <= 1e-12 * max(1.0, t):
                a = running[r]
                running[r] = None
                end[r] = t
                if a.kind == "B":
                    chunk_done[r][a.chunk] = t
        settle()
    return SimOut(makespan=max(end), end=end, busy_compute=bc, busy_comm=bm, chunk_done=chunk_done)


def single_program(M: int) -> list[Any]:
    from parallel.pipeline.p2p import Instr
    from parallel.pipeline.schedules import Action

    return [Instr("compute", action=Action(k, 0, m)) for m in range(M) for k in "FB"]


# --------------------------------------------------------------------------------------------------------------
# the whole step
# --------------------------------------------------------------------------------------------------------------
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
    from k3train.optim.newton_schulz import ns_flops
    from moonep.shard import is_expert_param

    out: dict[Any, list[float]] = {}
    for inf in facts.infos:
        ex = is_expert_param(inf.param)
        if opt_times is not None:
            from k3train.planning.layer_bench import opt_sig

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


def predict(cfg: Any, lay: Any, part: Any, programs: list[list[Any]], dev: Device, facts: ParamFacts,
            layer_times: Any = None, skew: float = 1.5, opt_times: dict[str, float] | None = None) -> Prediction:
    """Predicted seconds of one optimizer step of ``cfg`` under layout ``lay`` (module docstring)."""
    from parallel.pipeline.attnres_comm import AttnResCommPlan

    plan = AttnResCommPlan(part, cfg.parallel.attnres_comm) if lay.pp > 1 else None
    costs = action_costs(cfg, dev, lay, part, plan, layer_times, skew)
    dpcp = lay.dp * lay.cp
    sim = simulate_programs(programs, lay.pp, part.vpp, costs, dpcp, dev.rank_speed if dev.shares_cores else None)
    es = 2 if cfg.train.dtype == "bfloat16" else 4
    anchor = anchor_of(layer_times, cfg)
    total_numel = sum(p[0] + p[1] for p in facts.pieces.values())
    finish, opt, bcast, norm = [], [], [], []
    for r in range(lay.pp):
        d, e, _ = facts.stage_numel(part, r, lay.ep)
        # ParallelDims' groups of rank (r, 0, 0): dp_cp = the stage's dp*cp consecutive ranks, edp = every ep-th
        dg = range(r * dpcp, (r + 1) * dpcp)
        eg = range(r * dpcp, (r + 1) * dpcp, lay.ep)
        if lay.zero == 2:  # per chunk at its last backward, one link, overlapping the rest
            t_link = 0.0
            share = {c: 0.0 for c in range(part.vpp)}
            for c, (s, e_) in enumerate(part.local_chunks(r)):
                share[c] = (e_ - s) / max(1, sum(b - a for a, b in part.local_chunks(r)))
            for c in sorted(sim.chunk_done[r], key=lambda c: sim.chunk_done[r][c]):
                # optim/zero.py: one bucketed dist.reduce per owner of the group
                dur = (ring_time("reduce_scatter", d * es * share[c], dg, dev, calls=len(dg))
                       + ring_time("reduce_scatter", e * es * share[c], eg, dev, calls=len(eg)))
                t_link = max(t_link, sim.chunk_done[r][c]) + dur
            finish.append(max(sim.end[r], t_link))
        else:
            finish.append(sim.end[r] + ring_time("all_reduce", d * es, dg, dev) + ring_time("all_reduce", e * es, eg, dev))
        # every rank of the host updates at the same time
        opt.append(optimizer_seconds(facts, cfg, dev, part, r, lay, opt_times) / dev.rank_speed(lay.pp * dpcp))
        if anchor is not None:  # the norm's local work: the rank's share of the parameters' elements
            norm.append(anchor.grad_norm_s * (d + e) / max(1.0, total_numel) / dev.rank_speed(lay.pp * dpcp))
        bcast.append(0.0 if lay.zero == 0 else  # one broadcast per owner of the group
                     ring_time("all_gather", d * es, dg, dev, calls=len(dg))
                     + ring_time("all_gather", e * es, eg, dev, calls=len(eg)))
    # per-step small collectives (a traced step at world 2: 5-6 all-reduces): loss-token counts, grad norm, loss
    # sums, QB histograms (one batched call), QK-clip max, metrics; + the pp-group reductions of the metrics
    lat_all, _ = group_link(range(lay.pp * dpcp), dev)
    calls = 6 + (3 if lay.pp > 1 else 0)
    fixed = (calls * (dev.call_cost("all_reduce") + 2 * max(1, math.ceil(math.log2(max(2, lay.pp * dpcp)))) * lat_all)
             if lay.pp * dpcp > 1 else 0.0)
    # the breakdown is the bottleneck's: the pipeline rank with the most work (its idle time is the bubble)
    crit = max(range(lay.pp), key=lambda r: (sim.busy_compute[r] + sim.busy_comm[r], finish[r]))
    host = (max(norm) + anchor.host_step_s / dev.rank_speed(lay.pp * dpcp)) if anchor is not None else 0.0
    step = max(finish) + max(opt) + max(bcast) + fixed + host
    compute = sim.busy_compute[crit]
    in_action = sim.busy_comm[crit]
    bubble = max(0.0, sim.makespan - compute - in_action)
    optimizer = max(opt)
    exposed = max(0.0, step - compute - bubble - optimizer - host)
    return Prediction(step_s=step, compute=compute, exposed_comm=exposed, bubble=bubble, optimizer=optimizer,
                      host=host,
                      detail={"pipeline_s": sim.makespan, "in_action_comm_s": in_action,
                              "dp_reduce_s": max(finish) - sim.makespan, "param_bcast_s": max(bcast),
                              "fixed_collectives_s": fixed, "critical_pp_rank": crit,
                              "stage_f_s": costs.f, "stage_b_s": costs.b})


def compute_lower_bound(cfg: Any, lay: Any, part: Any, dev: Device, facts: ParamFacts, layer_times: Any,
                        skew: float, opt_times: dict[str, float] | None) -> float:
    """A lower bound on :func:`predict`: the busiest pipeline rank's own work (at the best rate its replicas
    allow) or one micro-batch's forward + backward chain through all virtual stages, whichever is longer, plus
    the worst stage's optimizer share. Used to skip simulating layouts that cannot make the top."""
    from parallel.pipeline.attnres_comm import AttnResCommPlan

    M = cfg.train.grad_accum_steps
    # memoised: the busy part does not depend on zero, the optimizer part not on the micro-batch shape
    kb = ("lb", id(part), lay.mbs, lay.cp, lay.ep, lay.moonep, lay.recompute, M, id(dev), id(layer_times), skew)
    if kb not in _MEMO:
        plan = AttnResCommPlan(part, cfg.parallel.attnres_comm) if lay.pp > 1 else None
        c = action_costs(cfg, dev, lay, part, plan, layer_times, skew)
        busy = max(sum(c.f[v] + c.b[v] + c.f_comm[v] + c.b_comm[v] for v in part.local_stages(r)) * M
                   for r in range(lay.pp))
        # one micro-batch's forward through every virtual stage and its backward back are a dependency chain
        chain = sum(c.f[v] + c.b[v] + c.f_comm[v] + c.b_comm[v] for v in range(part.num_stages))
        _MEMO[kb] = (busy, chain, part)
    ko = ("lbo", id(part), lay.ep, lay.zero, lay.dp * lay.cp, id(facts), id(dev), id(opt_times))
    if ko not in _MEMO:
        _MEMO[ko] = (max(optimizer_seconds(facts, cfg, dev, part, r, lay, opt_times) for r in range(lay.pp)), part)
    rate = dev.rank_speed(lay.dp * lay.cp)  # at least the busiest rank's replicas compute with it
    busy, chain, _ = _MEMO[kb]
    return max(busy / rate, chain) + _MEMO[ko][0] / dev.rank_speed(lay.pp * lay.dp * lay.cp)
