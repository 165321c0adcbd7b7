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
  GPUs ``min(E/ep, ceil((skew-1) E/ep))`` experts of ``3 l f`` each. What of it is exposed is what the layer's
  thread blocks on when the dispatcher's own order runs (:func:`layer_ops`, :func:`side_timeline`): the prefetch
  travels beside the token all-to-all and behind the own experts' compute, the reduce-back and the next backward's
  prefetch behind the own experts' backward, and under ``parallel.expert_wgrad_split`` the input gradients'
  all-to-all behind the own experts' weight-gradient matmuls; transfers in flight share the link. KCP -- per KDA layer one all-gather of the ``B x H x dk x (dk+dv)`` fp32 pairs forward and one backward;
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

Gradients (parameter dtype) over ``dp_cp`` (dense) and ``edp`` (routed experts), per chunk as soon as the chunk's
last backward ends (overlapping the rest of the pipeline): all-reduced at ZeRO 0/1, reduced to owners at ZeRO-2;
after the pipeline, the optimizer (Muon Newton-Schulz FLOPs + elementwise bytes; on cpu measured per parameter),
balanced over owners at ZeRO >= 1 (not below the largest parameter); ZeRO >= 1 then broadcasts the updated
parameters (all-gather bytes). ``--device cpu``: the trainer anchor (:class:`~k3train.planning.layer_bench.
TrainerAnchor`, one real one-process run of the config on this host) scales the measured layer and optimizer
times to what the trainer takes, and adds the gradient norm's own work (the rank's share of the parameters) and the
step's host work outside the timed phases (``Prediction.host``). Ranks are placed in ``ParallelDims``' order, ``gpus_per_node`` per node; a group
whose ranks share a node uses NVLink, else the inter-node link.
"""
from __future__ import annotations

import dataclasses
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


def forwards_before_first_backward(schedule: str, pp: int, vpp: int, num_microbatches: int,
                                   paired: bool = False) -> list[list[int]]:
    """Per pipeline rank, the local chunks of the forwards it runs before its first backward, then that backward's
    chunk last: the prefix of :func:`parallel.pipeline.schedules.build_schedule`'s action list up to the first
    backward (``schedule`` 'none': one rank, one forward; ``paired``: the schedule of F/B pairing). Only that
    prefix is built (the planner asks for thousands of (pp, vpp, micro-batches))."""
    from parallel.pipeline.schedules import interleaved_prefix, one_f_one_b_warmup

    M = num_microbatches
    if pp == 1 or schedule == "none":
        return [[0, 0]]
    if schedule == "afab":
        return [[c for c in range(vpp) for _ in range(M)] + [vpp - 1]] * pp
    if schedule == "1f1b":
        return [[0] * min(one_f_one_b_warmup(pp, r, M, paired) + 1, M) + [0] for r in range(pp)]
    return [interleaved_prefix(pp, vpp, r, M, paired) for r in range(pp)]


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


def _recv_blocks(part: Any, mode: str) -> list[list[int]]:
    """Per pipeline rank, per local chunk: the hidden-state-sized tensors its forward receives from the previous
    stage (the cached AttnRes plan's payload, ``memory.plan_bytes``), held by each micro-batch in flight until its
    backward (memoised per partition and mode)."""
    key = ("recv", id(part), mode)
    if key not in _MEMO:
        from parallel.pipeline.attnres_comm import AttnResCommPlan

        plan = AttnResCommPlan(part, mode) if part.pp > 1 else None
        out = [[len(plan.payload(v - 1).items()) if plan is not None and v > 0 else 0 for v in part.local_stages(r)]
               for r in range(part.pp)]
        _MEMO[key] = (out, part)
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


def _chunk_layers(cfg: Any, part: Any) -> list[list[tuple[int, int, tuple]]]:
    """Per pipeline rank, per local chunk: ``(layers, MoE layers, ((layer kind, is MoE), ...) in order)`` --
    what the activation terms of :func:`static_memory_lower_bound` read of a chunk (memoised per partition)."""
    from k3train.planning.memory import _layer_is_moe

    key = ("chunk_layers", id(part), id(cfg.model))
    if key not in _MEMO:
        out = []
        for r in range(part.pp):
            row = []
            for a, b in part.local_chunks(r):
                seq = tuple((cfg.model.layer_kind(i), _layer_is_moe(cfg, i)) for i in range(a, b))
                row.append((b - a, sum(moe for _, moe in seq), seq))
            out.append(row)
        _MEMO[key] = (out, part, cfg.model)
    return _MEMO[key][0]


def _pool_numel(facts: ParamFacts) -> float:
    """The largest MoE layer's expert numel (MoonEP's replica pool holds two banks of its local experts)."""
    key = ("pool", id(facts))
    if key not in _MEMO:
        _MEMO[key] = (max((v[1] for v in facts.pieces.values()), default=0.0), facts)
    return _MEMO[key][0]


def _sublayer_pieces(seq: tuple, mixer: dict[str, tuple[int, int]], ffn_saved: dict[bool, int],
                     embed: tuple[int, int] | None, head: tuple[int, int] | None) -> tuple[int, int]:
    """``(saved, backward peak)`` of one chunk's sublayer pieces in order (the estimator's composition, memoised
    by the pieces' bytes: the planner bounds a million layouts over a few thousand distinct chunks)."""
    key = ("sublayer", seq, tuple(sorted(mixer.items())), tuple(sorted(ffn_saved.items())), embed, head)
    if key not in _MEMO:
        from k3train.planning.memory import _compose

        pieces = [embed] if embed is not None else []
        for kind, moe in seq:
            pieces.append(mixer[kind])
            pieces.append((ffn_saved[moe],) * 2)
        if head is not None:
            pieces.append(head)
        saved, _, b_peak = _compose([(sv, 0, b) for sv, b in pieces])
        _MEMO[key] = (saved, b_peak)
    return _MEMO[key]


def static_memory_lower_bound(facts: ParamFacts, cfg: Any, part: Any, pp: int, dpcp: int, ep: int,
                              zero: int, moonep: bool = False, tokens: int = 0, recompute: str | None = None,
                              in_flight: list[list[int]] | None = None,
                              ffn_saved: dict[bool, int] | None = None,
                              mixer: dict[str, tuple[int, int]] | None = None,
                              ends: dict[str, tuple[int, int]] | None = None) -> int:
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

    ``ffn_saved`` (``recompute`` ``"sublayer"`` or None: :func:`k3train.planning.memory.ffn_saved_bytes`,
    ``{is_moe: bytes}``, traced under the same recompute setting; a part of each layer whether the estimator
    composes the micro-batch per piece or traces its chunks whole):
    each FFN counts what its traced sublayer keeps -- under sublayer recomputation the very bytes the estimator
    composes for it; without recomputation a part of its layer's (the same FFN ops on the same shapes, the mixer's
    output their input) -- the same for every cp, instead of one or two hidden states; the token mixer counts one
    (its partial sum). ``mixer`` (with ``ffn_saved``, ``recompute`` ``"sublayer"``:
    :func:`k3train.planning.memory.mixer_bytes`, ``{kind: (saved, b_peak)}`` at this cp): each token mixer counts its
    traced piece's saved bytes, and the first backward's chunk is composed as the estimator composes it (sublayers in
    order, the peak of each sublayer's backward on top of what the earlier ones keep; an FFN's backward counted at its
    saved bytes): the MLA keys of every cp segment that a backward's recomputed mixer gathers are in the bound, the
    layouts whose cp makes them too big drop out without a trace. Both may be traced on one row of a micro-batch of
    several (the planner does: a micro-batch holds at least what one of its rows holds), ``tokens`` being the whole
    micro-batch's. ``ends`` (with ``mixer``: :func:`k3train.planning.memory.end_bytes`, ``{"embed", "head": (saved,
    b_peak)}``): the first chunk's embedding and the last chunk's head (the MTP layer) are composed in too, as the
    estimator composes them. Over several stages every forward in flight also holds the payload its chunk received
    (the cached AttnRes plan's partial sum and blocks, :func:`_recv_blocks`) until its backward, as the estimator
    holds it: at K3's 1M context the later stages' largest term after the sublayers'."""
    es = 2 if cfg.train.dtype == "bfloat16" else 4
    master = 4 if es != 4 else 0
    edp = max(1, dpcp // ep)
    pool = 0.0
    if moonep and ep > 1:
        pool = 2 * _pool_numel(facts) / ep * es
    best = 0.0
    h = tokens * cfg.model.hidden_size * es
    layers_of = _chunk_layers(cfg, part)
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
        elif recompute == "sublayer" and ffn_saved is not None and mixer is not None:
            def pieces(c: int) -> tuple[int, int]:  # (saved, backward peak) of chunk c's pieces
                embed = ends["embed"] if ends is not None and r == 0 and c == 0 else None
                head = ends["head"] if ends is not None and r == pp - 1 and c == len(chunks) - 1 else None
                return _sublayer_pieces(layers_of[r][c][2], mixer, ffn_saved, embed, head)

            saved = {c: pieces(c)[0] for c in set(fwd) | {first_b}}
            act = sum(k * saved[c] for c, k in fwd.items()) - saved[first_b] + pieces(first_b)[1]
        elif recompute in ("sublayer", None) and ffn_saved is not None:
            def kept(c: int) -> int:  # one hidden state per mixer, the traced bytes per FFN
                n_layers, n_moe, _ = layers_of[r][c]
                return (n_layers * h + (n_moe * ffn_saved[True] if n_moe else 0)
                        + ((n_layers - n_moe) * ffn_saved[False] if n_layers > n_moe else 0))

            act = sum(k * kept(c) for c, k in fwd.items())
        else:
            hidden = {"layer": 1, "sublayer": 2}.get(recompute, 4)
            act = hidden * sum(k * (chunks[c][1] - chunks[c][0]) for c, k in fwd.items()) * h
        # every forward in flight (the first backward's among them) holds what it received until its backward
        recv = _recv_blocks(part, cfg.parallel.attnres_comm)[r]
        act += sum(k * recv[c] for c, k in fwd.items()) * h
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
    comm_kinds: list[dict[str, float]] = field(default_factory=list)  # per stage: f_comm + b_comm by kind


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


def comm_per_layer(cfg: Any, dev: Device, lay: Any, skew: float, p2p: list[list[int]] | None = None,
                   kinds: list[dict[str, float]] | None = None) -> tuple[list[float], list[float]]:
    """Per layer (forward, backward) exposed EP / KCP / MLA-CP seconds per micro-batch (module docstring); the
    list has one more entry than the backbone: the MTP layer (MLA attention + the last layer's FFN kind), which
    runs on the last stage. ``kinds``, if given, receives per layer ``{kind: (forward, backward) seconds}`` over
    :data:`IN_ACTION_KINDS` (the same terms, by collective). Call counts are the implementation's (checked against a traced step). ``p2p``: per
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
        by: dict[str, tuple[float, float]] = {}

        def mark(k: str) -> None:  # what f and b gained since the previous mark is kind k's
            by[k] = (f - sum(x[0] for x in by.values()), b - sum(x[1] for x in by.values()))

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
            mark("ep_all_to_all")
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
            mark("moonep_replicas")
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
                mark("kcp")
            else:
                lat_b = B * T * lay.cp * (m.kv_lora_rank + m.qk_rope_head_dim) * es
                f += ring_time("all_gather", lat_b, cp_ranks, dev)
                b += ring_time("reduce_scatter", lat_b, cp_ranks, dev)
                if cfg.parallel.mla_cp_balance:  # kcp/mla_cp.py: x out / y back forward, dy / dx backward
                    lat, bwid = group_link(cp_ranks, dev)
                    swap = dev.call_cost("all_to_all") + lat + B * (T - T // 2) * m.hidden_size * es / bwid
                    f += 2 * swap
                    b += 2 * swap
                mark("mla_cp")
        fw.append(f)
        bw.append(b)
        if kinds is not None:
            kinds.append(by)
    if lay.cp > 1:  # kcp/context.py: the layout exchange of every micro-batch (shapes, document edges)
        ex = ring_time("all_gather", lay.cp * B * 64, cp_ranks, dev, calls=2)
        fw[0] += ex
        if kinds is not None:
            kinds[0]["kcp"] = (kinds[0].get("kcp", (0.0, 0.0))[0] + ex, kinds[0].get("kcp", (0.0, 0.0))[1])
    return fw, bw


# the in-action collectives by kind (comm_per_layer), and the rest of a step's communication (predict)
IN_ACTION_KINDS = ("ep_all_to_all", "moonep_replicas", "kcp", "mla_cp")


_MEMO: dict[tuple, Any] = {}


def routed_share(cfg: Any, lay: Any, i: int, skew: float) -> float:
    """The routed experts' share of layer ``i``'s compute (their share of its FLOPs, ``partition.layer_cost``; the
    busiest rank's under plain EP; ``i`` past the backbone: the MTP layer, taken as the last layer's FFN kind)."""
    from parallel.pipeline.partition import layer_cost

    m = cfg.model
    L = m.num_hidden_layers
    routed = 2.0 * m.num_experts_per_token * 3 * m.expert_hidden_size * m.moe_intermediate_size * (
        1.0 if lay.moonep else skew)
    return min(1.0, routed / layer_cost(m, min(i, L - 1), cfg.train.seq_len // lay.cp))


def side_timeline(ops: list[tuple], in_line: bool = False) -> tuple[list[tuple[str, float]], dict[str, float]]:
    """One thread's program of computes and transfers, executed: ``('c', s)`` computes ``s`` seconds; ``('start',
    name, kind, s)`` starts a transfer of ``s`` link-seconds (async); ``('wait', name)`` blocks until it is done;
    ``('sync', kind, s)`` is a start and its wait. Transfers in flight share the rank's link equally and run while
    the thread computes. Returns the phases the thread spends (``('c', s)`` computing, ``('n', s)`` blocked in a
    wait, consecutive ones merged) and the blocked seconds by the kind of the transfer waited for; transfers still
    in flight at the end are waited for there, in start order. ``in_line``: every transfer is waited for as soon
    as it starts (a host whose ranks share its cores: computing ranks leave no core for a transfer to progress on,
    and a collective waits for descheduled peers -- what ``Device.call_cost`` measured)."""
    live: dict[str, list] = {}  # name -> [link-seconds left, kind], in start order
    phases: list[tuple[str, float]] = []
    blocked: dict[str, float] = {}

    def run(dt: float, until: str | None = None) -> float:  # advance the link; returns the seconds spent
        spent = 0.0
        while live and (until is None and dt > 0 or until is not None and until in live):
            n = len(live)
            step = min(v[0] for v in live.values()) * n
            if until is None and step > dt:
                for v in live.values():
                    v[0] -= dt / n
                return spent + dt
            for v in live.values():
                v[0] -= step / n
            for k in [k for k, v in live.items() if v[0] <= 1e-15]:
                del live[k]
            spent += step
            dt -= step
        return spent

    def add(kind: str, sec: float) -> None:
        if sec > 0.0:
            phases.append((kind, phases.pop()[1] + sec) if phases and phases[-1][0] == kind else (kind, sec))

    def wait(name: str) -> None:
        kind = live[name][1]
        t = run(0.0, until=name)
        add("n", t)
        blocked[kind] = blocked.get(kind, 0.0) + t

    for op in ops:
        if op[0] == "c":
            run(op[1])
            add("c", op[1])
        elif op[0] == "start":
            if op[3] > 0.0:
                live[op[1]] = [op[3], op[2]]
                if in_line:
                    wait(op[1])
        elif op[0] == "wait":
            if op[1] in live:
                wait(op[1])
        else:  # sync
            if op[2] > 0.0:
                live["_sync"] = [op[2], op[1]]
                wait("_sync")
    for name in list(live):
        if name in live:
            wait(name)
    return phases, blocked


def layer_ops(direction: str, sent: dict[str, tuple[float, float]], experts: float, other: float, own: float,
              split: bool, es: int) -> list[tuple]:
    """One layer's forward (``direction`` 'f') or backward ('b') as its thread issues it, for :func:`side_timeline`:
    ``sent`` the layer's in-action communication by kind as sent (:func:`comm_per_layer`), ``experts`` / ``other``
    the routed experts' and the rest's compute seconds, ``own`` the share of the expert rows the rank computes for
    its own experts (the rest are MoonEP replicas). A MoE layer follows moonep/dispatcher.py:

    * forward: the rest of the layer; the token all-to-all and the replica prefetch start together; the own
      experts once the tokens are in, the replicas once their weights are; the combine all-to-all;
    * backward: the combine's all-to-all; the next backward's replicas start travelling (prefetched ahead); the
      replicas' backward, whose fp32 weight gradients start travelling home (reduce-back); the own experts'
      backward -- under ``split`` (``parallel.expert_wgrad_split``) the input gradients first, then their
      all-to-all starts and the weight gradients are computed while it travels, else all of it and then the
      all-to-all; both transfers waited for; the rest of the layer, and the prefetch waited for at its end (the
      next layer's backward waits for it, in line).

    MoonEP's backward replica traffic (``moonep_replicas``) splits into the re-fetch (``es`` bytes per weight) and
    the reduce-back (fp32) by their bytes. KCP / MLA-CP collectives run in line, before the MoE part in the
    backward and after it in the forward."""
    i = 0 if direction == "f" else 1
    rest = [("sync", k, v[i]) for k, v in sent.items() if k not in ("ep_all_to_all", "moonep_replicas")]
    a2a, rp = sent.get("ep_all_to_all", (0.0, 0.0))[i], sent.get("moonep_replicas", (0.0, 0.0))[i]
    if a2a == 0.0:
        return [("c", other + experts)] + rest if direction == "f" else rest + [("c", other + experts)]
    mine, reps = experts * own, experts * (1.0 - own)
    if direction == "f":
        return [("c", other), ("start", "tok", "ep_all_to_all", a2a / 2), ("start", "w", "moonep_replicas", rp),
                ("wait", "tok"), ("c", mine), ("wait", "w"), ("c", reps), ("sync", "ep_all_to_all", a2a / 2)] + rest
    fetch, back = rp * es / (es + 4), rp * 4 / (es + 4)
    own_bwd = ([("c", mine / 2), ("start", "tok", "ep_all_to_all", a2a / 2), ("c", mine / 2)] if split else
               [("c", mine), ("start", "tok", "ep_all_to_all", a2a / 2)])
    return rest + [("sync", "ep_all_to_all", a2a / 2), ("start", "ahead", "moonep_replicas", fetch), ("c", reps),
                   ("start", "back", "moonep_replicas", back)] + own_bwd + [
                   ("wait", "back"), ("wait", "tok"), ("c", other), ("wait", "ahead")]


def own_row_share(lay: Any, skew: float, sent: dict[str, tuple[float, float]]) -> float:
    """The share of its ``N*k`` expert rows a rank computes for its own experts: all of them under plain EP or
    when MoonEP fetches no replica; else ``1 / skew`` (MoonEP moves the excess of the busiest ranks, about
    ``(skew - 1) / skew`` of their rows, onto replicas)."""
    if not lay.moonep or sent.get("moonep_replicas", (0.0, 0.0)) == (0.0, 0.0):
        return 1.0
    return 1.0 / max(1.0, skew)


def _layer_terms(cfg: Any, dev: Device, lay: Any, layer_times: Any, skew: float) -> tuple:
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
                                                     cfg.parallel.expert_wgrad_split, _dtype_bytes(cfg)),
                                           in_line=dev.shares_cores)
                by[d] = blocked
            exposed.append({k: (by["f"].get(k, 0.0), by["b"].get(k, 0.0)) for k in kind})
            cf[j] = sum(v[0] for v in exposed[j].values())
            cb[j] = sum(v[1] for v in exposed[j].values())
        _MEMO[key] = (compute, (cf, cb), exposed, sent,
                      (cfg.model, dev, layer_times))  # keep the id()s alive
    return _MEMO[key][:4]


def _dtype_bytes(cfg: Any) -> int:
    return 2 if cfg.train.dtype == "bfloat16" else 4


def action_costs(cfg: Any, dev: Device, lay: Any, part: Any, plan: Any, layer_times: Any,
                 skew: float) -> ActionCosts:
    import torch

    from k3train.planning.memory import plan_bytes

    (emb, layers, head), (cf, cb), kinds, _ = _layer_terms(cfg, dev, lay, layer_times, skew)
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
        dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
        T = cfg.train.seq_len // lay.cp
        stride = lay.dp * lay.cp
        for bd in range(n - 1):
            nbytes = plan_bytes(plan, bd, lay.mbs, T, cfg.model.hidden_size, dtype)
            src, dst = (bd % lay.pp) * stride, ((bd + 1) % lay.pp) * stride
            lat, bwid = dev.link(node_of(src, dev) == node_of(dst, dev))
            msg[bd] = (lat + dev.call_cost("p2p"), nbytes / bwid)
    return ActionCosts(f=f, b=b, f_comm=fc, b_comm=bc, msg_s=msg, comm_kinds=ck)


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
                      speed: Callable[[int], float] | None = None, pairs: Any = None) -> SimOut:
    """Event-driven run of every pipeline rank's program (module docstring). ``replicas``: ranks doing the same
    work at the same time (dp x cp); ``speed(n)``: a rank's speed (1 = alone) while ``n`` ranks of the host
    compute (:meth:`Device.rank_speed`; None: a device each). ``pairs``: ``(firsts, f_phases, b_phases)`` of F/B
    pairing (the programs :func:`parallel.pipeline.p2p_programs.pair_programs` returned, its ``firsts``, and
    :func:`side_phases`): a pair starts once both computes' inputs are there and runs their compute together with
    what :func:`pair_seconds` leaves of their in-action communication (at full speed). The pair's first compute
    ``X`` posts its trailing sends as soon as its side is done, while the second still runs (the runner's
    ``run_pair``): the pair runs as two segments, split where :func:`pair_side_ends` ends ``X``'s side at full
    speed (each segment that share of the pair's compute and of its communication, so the whole is unchanged),
    and ``X``'s posts leave between them."""
    progs = _precompiled(programs, pp, vpp)
    inf = float("inf")
    pos = [0] * pp
    arrival: dict[Any, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    rem = [0.0] * pp          # remaining compute of the running action (seconds at full speed)
    rem_comm = [0.0] * pp     # then its in-action communication (wall seconds: measured while every rank computes)
    running: list[Any] = [None] * pp
    second: list[tuple | None] = [None] * pp  # a pair: (compute, communication, X's posts) after X's side ends
    wait: list[tuple] = [()] * pp  # deps of the compute a rank is blocked on
    t = 0.0
    end = [0.0] * pp
    bc, bm = [0.0] * pp, [0.0] * pp
    chunk_done: list[dict[int, float]] = [{} for _ in range(pp)]
    chunk_b: list[int | None] = [None] * pp  # the chunk of the backward the running action holds (if any)
    done = [False] * pp

    def post(r: int, ins: tuple) -> None:
        if ins[0] == "send":
            msg, dst = ins[1], ins[2]
            lat, xfer = costs.msg_s.get(msg.stage, (0.0, 0.0))
            k = (r, dst)
            start = max(t, link_free.get(k, 0.0))
            link_free[k] = start + xfer
            arrival[msg] = start + xfer + lat
        pos[r] += 1

    def advance(r: int) -> None:
        prog = progs[r]
        wait[r] = ()
        while pos[r] < len(prog):
            ins = prog[pos[r]]
            if ins[0] != "comp":
                post(r, ins)
            else:
                a, v, deps = ins[1], ins[2], ins[3]
                two = pairs is not None and a in pairs[0][r]
                if two:
                    a2, v2, deps2 = prog[pos[r] + 1][1:4]
                    deps = deps + deps2
                if any(arrival.get(d, inf) > t + 1e-15 for d in deps):
                    wait[r] = deps
                    return
                comp, comm = (costs.f[v], costs.f_comm[v]) if a.kind == "F" else (costs.b[v], costs.b_comm[v])
                if two:
                    fv, bv = (v, v2) if a.kind == "F" else (v2, v)
                    comp = costs.f[fv] + costs.b[bv]
                    ends = pair_side_ends(pairs[1][fv], pairs[2][bv])
                    total = max(ends)
                    comm = max(0.0, total - comp)
                    x = min(1.0, ends[0 if a.kind == "F" else 1] / total) if total > 0.0 else 1.0
                    second[r] = (comp * (1.0 - x), comm * (1.0 - x), pairs[0][r][a])
                    comp, comm = comp * x, comm * x
                    chunk_b[r] = (a if a.kind == "B" else a2).chunk
                    pos[r] += 1
                else:
                    chunk_b[r] = a.chunk if a.kind == "B" else None
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
            if rem[r] <= 0.0 and rem_comm[r] <= 1e-12 * max(1.0, t) and second[r] is not None:
                rem[r], rem_comm[r], n = second[r]  # X's side is done: its posts leave, the pair goes on
                second[r] = None
                for _ in range(n):
                    post(r, progs[r][pos[r]])
            if rem[r] <= 0.0 and rem_comm[r] <= 1e-12 * max(1.0, t):
                running[r] = None
                end[r] = t
                if chunk_b[r] is not None:
                    chunk_done[r][chunk_b[r]] = t
        settle()
    return SimOut(makespan=max(end), end=end, busy_compute=bc, busy_comm=bm, chunk_done=chunk_done)


# --------------------------------------------------------------------------------------------------------------
# F/B pairing (parallel.overlap_ep, parallel/pairing.py): an F and a B of two micro-batches at once
# --------------------------------------------------------------------------------------------------------------
def pairs_actions(cfg: Any) -> bool:
    """Whether the runtime pairs computes in this layout (``Config.ep_overlap``: its one rule)."""
    return cfg.ep_overlap()[0]


_PAIRED: dict[int, tuple[Any, Any]] = {}


def paired_programs(programs: list[list[Any]], pp: int, vpp: int) -> tuple[list[list[Any]], list[dict]]:
    """:func:`parallel.pipeline.p2p_programs.pair_programs` of ``programs`` (memoised per programs object),
    what the runner executes under ``parallel.overlap_ep``."""
    from parallel.pipeline.p2p_programs import pair_programs

    if id(programs) not in _PAIRED or _PAIRED[id(programs)][0] is not programs:
        _PAIRED[id(programs)] = (programs, pair_programs(programs, pp, vpp))
    return _PAIRED[id(programs)][1]


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
    (emb, layers, head), _, _, sent = _layer_terms(cfg, dev, lay, layer_times, skew)
    L = len(layers)
    split, es = cfg.parallel.expert_wgrad_split, _dtype_bytes(cfg)

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
            layer_times: Any = None, skew: float = 1.5, opt_times: dict[str, float] | None = None,
            split_p2p: bool = False) -> Prediction:
    """Predicted seconds of one optimizer step of ``cfg`` under layout ``lay`` (module docstring).
    ``detail['exposed_by_kind']`` splits the exposed communication by what it is (it sums to ``exposed_comm``):
    the in-action kinds of :data:`IN_ACTION_KINDS` on the critical pipeline rank, the gradient reduction left after
    the pipeline, ZeRO's parameter all-gather and the per-step small collectives. ``split_p2p``: the programs are
    simulated once more with free pipeline messages; ``detail['p2p_in_bubble_s']`` is how much longer the
    pipeline takes for its point-to-point transfers (a part of the bubble)."""
    from parallel.pipeline.attnres_comm import AttnResCommPlan

    plan = AttnResCommPlan(part, cfg.parallel.attnres_comm) if lay.pp > 1 else None
    costs = action_costs(cfg, dev, lay, part, plan, layer_times, skew)
    dpcp = lay.dp * lay.cp
    paired = pairs_actions(cfg)
    pairs = None
    if paired:  # parallel.overlap_ep: the runner's own pairing of the programs (parallel/pipeline/runner.py)
        programs, firsts = paired_programs(programs, lay.pp, part.vpp)
        pairs = (firsts, *side_phases(cfg, dev, lay, part, layer_times, skew))
    sim = simulate_programs(programs, lay.pp, part.vpp, costs, dpcp, dev.rank_speed if dev.shares_cores else None,
                            pairs)
    es = 2 if cfg.train.dtype == "bfloat16" else 4
    anchor = anchor_of(layer_times, cfg)
    total_numel = sum(p[0] + p[1] for p in facts.pieces.values())
    finish, opt, bcast, norm = [], [], [], []
    for r in range(lay.pp):
        d, e, _ = facts.stage_numel(part, r, lay.ep)
        # ParallelDims' groups of rank (r, 0, 0): dp_cp = the stage's dp*cp consecutive ranks, edp = every ep-th
        dg = range(r * dpcp, (r + 1) * dpcp)
        eg = range(r * dpcp, (r + 1) * dpcp, lay.ep)
        # per chunk at its last backward (parallelize.set_chunk_backward_hook), one link, overlapping the rest:
        # ZeRO-2 one bucketed dist.reduce per owner of the group, ZeRO 0 / 1 an all-reduce (optim/zero.py)
        t_link = 0.0
        share = {c: 0.0 for c in range(part.vpp)}
        for c, (s, e_) in enumerate(part.local_chunks(r)):
            share[c] = (e_ - s) / max(1, sum(b - a for a, b in part.local_chunks(r)))
        for c in sorted(sim.chunk_done[r], key=lambda c: sim.chunk_done[r][c]):
            if lay.zero == 2:
                dur = (ring_time("reduce_scatter", d * es * share[c], dg, dev, calls=len(dg))
                       + ring_time("reduce_scatter", e * es * share[c], eg, dev, calls=len(eg)))
            else:
                dur = ring_time("all_reduce", d * es * share[c], dg, dev) + ring_time("all_reduce", e * es * share[c],
                                                                                      eg, dev)
            t_link = max(t_link, sim.chunk_done[r][c]) + dur
        finish.append(max(sim.end[r], t_link))
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


def compute_lower_bound(cfg: Any, lay: Any, part: Any, dev: Device, facts: ParamFacts, layer_times: Any,
                        skew: float, opt_times: dict[str, float] | None) -> float:
    """A lower bound on :func:`predict`: per pipeline rank, its own work (at the best rate its replicas allow)
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
