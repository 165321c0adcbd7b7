"""The static memory bound: a lower bound on a layout's worst rank's peak from its parameters, gradients and
optimizer state, and from what each forward in flight keeps (with the traced pieces' bytes where the planner has
them) -- no trace of the layout itself."""
from __future__ import annotations

from typing import Any

from k3train.planning.dtypes import dtype_bytes
from k3train.planning.memory.buffers import payload_tensors
from k3train.planning.memory.compose import compose
from k3train.planning.step_time.facts import ParamFacts
from parallel.pipeline.attnres_comm import AttnResCommPlan

_MEMO: dict[tuple, Any] = {}


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
    stage (the cached AttnRes plan's payload, ``memory.buffers.plan_bytes``), held by each micro-batch in flight until
    its backward (memoised per partition and mode)."""
    key = ("recv", id(part), mode)
    if key not in _MEMO:
        plan = AttnResCommPlan(part, mode) if part.pp > 1 else None
        out = [[payload_tensors(plan, v - 1) if plan is not None and v > 0 else 0 for v in part.local_stages(r)]
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
    key = ("chunk_layers", id(part), id(cfg.model))
    if key not in _MEMO:
        out = []
        for r in range(part.pp):
            row = []
            for a, b in part.local_chunks(r):
                seq = tuple((cfg.model.layer_kind(i), cfg.model.is_moe_layer(i)) for i in range(a, b))
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


def _sublayer_pieces(seq: tuple, mixer: dict[str, tuple[int, int]], ffn_saved: dict[bool, Any],
                     embed: tuple[int, int] | None, head: tuple[int, int] | None) -> tuple[int, int]:
    """``(saved, backward peak)`` of one chunk's sublayer pieces in order (the estimator's composition, memoised
    by the pieces' bytes: the planner bounds a million layouts over a few thousand distinct chunks); an FFN's
    backward peak is its traced one where ``ffn_saved`` holds ``(saved, b_peak)``, else its saved bytes."""
    key = ("sublayer", seq, tuple(sorted(mixer.items())), tuple(sorted(ffn_saved.items())), embed, head)
    if key not in _MEMO:
        pieces = [embed] if embed is not None else []
        for kind, moe in seq:
            pieces.append(mixer[kind])
            pieces.append(ffn_pair(ffn_saved[moe]))
        if head is not None:
            pieces.append(head)
        saved, _, b_peak = compose([(sv, 0, b) for sv, b in pieces])
        _MEMO[key] = (saved, b_peak)
    return _MEMO[key]


def ffn_pair(v: Any) -> tuple[int, int]:
    """An FFN piece's ``(saved, backward peak)`` from ``ffn_saved``'s value: the pair, or saved bytes alone."""
    return (int(v[0]), int(v[1])) if isinstance(v, tuple) else (int(v), int(v))


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
    (:func:`~.programs.forwards_before_first_backward`): the forwards the schedule runs before a rank's first backward each
    keep theirs; without it one forward of every local chunk. With the weights and optimizer state (no gradients:
    those of the chunk may still be forming) that is a bound too, and at long context the one that rules layouts
    out (a 1M row over few pipeline stages, or many micro-batches in flight).

    ``ffn_saved`` (``recompute`` ``"sublayer"`` or None: :func:`~.piece_bytes.ffn_saved_bytes`,
    ``{is_moe: bytes}``, traced under the same recompute setting; a part of each layer whether the estimator
    composes the micro-batch per piece or traces its chunks whole):
    each FFN counts what its traced sublayer keeps -- under sublayer recomputation the very bytes the estimator
    composes for it; without recomputation a part of its layer's (the same FFN ops on the same shapes, the mixer's
    output their input) -- the same for every cp, instead of one or two hidden states; the token mixer counts one
    (its partial sum). ``mixer`` (with ``ffn_saved``, ``recompute`` ``"sublayer"``:
    :func:`~.piece_bytes.mixer_bytes`, ``{kind: (saved, b_peak)}`` at this cp): each token mixer counts its
    traced piece's saved bytes, and the first backward's chunk is composed as the estimator composes it (sublayers in
    order, the peak of each sublayer's backward on top of what the earlier ones keep; an FFN's backward counted at its
    saved bytes): the MLA keys of every cp segment that a backward's recomputed mixer gathers are in the bound, the
    layouts whose cp makes them too big drop out without a trace. Both may be traced on one row of a micro-batch of
    several (the planner does: a micro-batch holds at least what one of its rows holds), ``tokens`` being the whole
    micro-batch's. ``ends`` (with ``mixer``: :func:`~.piece_bytes.end_bytes`, ``{"embed", "head": (saved,
    b_peak)}``): the first chunk's embedding and the last chunk's head (the MTP layer) are composed in too, as the
    estimator composes them. Over several stages every forward in flight also holds the payload its chunk received
    (the cached AttnRes plan's partial sum and blocks, :func:`_recv_blocks`) until its backward, as the estimator
    holds it: at K3's 1M context the later stages' largest term after the sublayers'."""
    es = dtype_bytes(cfg)
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
        act = _activations(cfg, part, r, pp, chunks, layers_of[r], (fwd, first_b), h, recompute, ffn_saved, mixer,
                           ends)
        best = max(best, n * es + grads + opt + pool, n * es + opt + pool + act)
    return int(best)


def _activations(cfg: Any, part: Any, r: int, pp: int, chunks: list, layers: list[tuple[int, int, tuple]],
                 flight: tuple[dict[int, int], int], h: int, recompute: str | None,
                 ffn_saved: dict[bool, Any] | None, mixer: dict[str, tuple[int, int]] | None,
                 ends: dict[str, tuple[int, int]] | None) -> float:
    """What pipeline rank ``r``'s forwards in flight keep (``flight``: ``({local chunk: forwards}, chunk of the first
    backward)``), and its first backward, per :func:`static_memory_lower_bound`'s rules (``layers``: the rank's
    :func:`_chunk_layers`; ``h``: one hidden state's bytes)."""
    fwd, first_b = flight

    def pieces(c: int) -> tuple[int, int]:  # (saved, backward peak) of chunk c's pieces
        embed = ends["embed"] if ends is not None and r == 0 and c == 0 else None
        head = ends["head"] if ends is not None and r == pp - 1 and c == len(chunks) - 1 else None
        return _sublayer_pieces(layers[c][2], mixer, ffn_saved, embed, head)

    if recompute == "chunk":  # a forward keeps only its input (received: below); the first backward recomputes
        # its chunk, every layer's activations at once: the pieces traced without recomputation, composed
        act = (pieces(first_b)[1] if ffn_saved is not None and mixer is not None
               else 2 * (chunks[first_b][1] - chunks[first_b][0]) * h)
    elif recompute in ("sublayer", None) and ffn_saved is not None and mixer is not None:
        saved = {c: pieces(c)[0] for c in set(fwd) | {first_b}}
        act = sum(k * saved[c] for c, k in fwd.items()) - saved[first_b] + pieces(first_b)[1]
    elif recompute in ("sublayer", None) and ffn_saved is not None:
        def kept(c: int) -> int:  # one hidden state per mixer, the traced bytes per FFN
            n_layers, n_moe, _ = layers[c]
            return (n_layers * h + (n_moe * ffn_pair(ffn_saved[True])[0] if n_moe else 0)
                    + ((n_layers - n_moe) * ffn_pair(ffn_saved[False])[0] if n_layers > n_moe else 0))

        act = sum(k * kept(c) for c, k in fwd.items())
    else:
        hidden = {"layer": 1, "sublayer": 2}.get(recompute, 4)
        act = hidden * sum(k * (chunks[c][1] - chunks[c][0]) for c, k in fwd.items()) * h
    # every forward in flight (the first backward's among them) holds what it received until its backward
    recv = _recv_blocks(part, cfg.parallel.attnres_comm)[r]
    act += sum(k * recv[c] for c, k in fwd.items()) * h
    return act


def family_memory_lower_bound(facts: ParamFacts, cfg: Any, pp: int, dpcp: int, ep: int, zero: int) -> int:
    """A lower bound on :func:`static_memory_lower_bound` of every layout with these ``pp``, ``dp x cp`` and ``ep``
    and a ZeRO stage no lower than ``zero``, whatever its partition, schedule or micro-batch: the average
    pipeline stage's weights, gradients and optimizer state (each term grows linearly in a stage's parameters,
    so the busiest stage holds at least the average's) -- what rules out most of K3's families at once."""
    es = dtype_bytes(cfg)
    master = 4 if es != 4 else 0
    edp = max(1, dpcp // ep)
    dense = sum(v[0] for v in facts.pieces.values()) / pp
    expert = sum(v[1] for v in facts.pieces.values()) / (pp * ep)
    n = dense + expert
    shard = dense / dpcp + expert / edp
    grads = n * es if zero < 2 else shard * es
    opt = n * (4 + master) if zero == 0 else shard * (4 + master)
    return int(n * es + grads + opt)
