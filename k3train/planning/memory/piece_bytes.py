"""What the planner's static memory bound reads of the composed pieces: the FFN sublayers' saved bytes, the token
mixers', and the end pieces' (the very fits and cache entries the estimate composes). Each takes the ``at`` and
``clamp`` of :func:`~.pieces.trace_piece`: the same fits evaluated at ``at`` tokens, unrounded."""
from __future__ import annotations

from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.model.model import CE_CHUNK_TOKENS
from k3train.planning.memory.pieces import most_keys_rank, piece_layers, trace_piece


def ffn_saved_bytes(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, B: int, T: int,
                    deadline: float | None = None, at: int | None = None, clamp: bool = True) -> dict[bool, Any]:
    """``{is_moe: bytes}``: what one micro-batch's FFN sublayer keeps from its forward to its backward, dense and
    MoE, under ``cfg``'s recompute setting -- under sublayer recomputation the very pieces (same fits, same
    ``cache`` entries) that :func:`trace_chunk` composes for every layer of a chunk at ``B x T`` tokens when it
    does not trace it whole; without recomputation the FFN ops of each layer piece, traced alone. They do not
    depend on cp (:func:`piece_depends_on_cp`), which makes them a lower-bound term the planner computes once for
    every layout (``search.memory_bound.static_memory_lower_bound``)."""
    reps = piece_layers(cfg)
    moe_chunk = cfg.model.moe_token_chunk if cfg.model.num_experts > 0 else 0
    out = {}
    for moe in sorted({k[1] for k in reps if k[0] == "ffn"}):
        i = reps[("ffn", moe)]
        out[moe] = trace_piece(cfg, model, fake, cache, ("ffn", moe), i, i + 1, False, False, "ffn",
                               (moe_chunk,) if moe else (), B=B, T=T, deadline=deadline, at=at, clamp=clamp)[0]
    return out


def mixer_bytes(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, B: int, T: int,
                deadline: float | None = None, at: int | None = None,
                clamp: bool = True) -> dict[str, tuple[Any, Any]]:
    """``{layer kind: (saved, b_peak)}`` of each token-mixer sublayer under ``cfg``'s recompute setting (without
    recomputation: the mixer's ops of each layer piece, traced alone), on the CP rank whose MLA attends over the
    most key segments (under balance rank 0, else the last): under sublayer recomputation the very pieces
    :func:`trace_chunk` composes for that rank at ``B x T`` tokens (same fits, same ``cache`` entries; above
    CP_TRACED_MAX from the cp line). With :func:`ffn_saved_bytes` what the planner's static bound composes a
    chunk's sublayers from: the MLA keys of all the cp segments and the KDA pairs of the group are in them."""
    reps = piece_layers(cfg)
    rank = most_keys_rank(cfg)
    out = {}
    for kind in sorted({k[1] for k in reps if k[0] == "mixer"}):
        i = reps[("mixer", kind)]
        saved, _, b_peak = trace_piece(cfg, model, fake, cache, ("mixer", kind), i, i + 1, False, False, "mixer", (),
                                       kind, B=B, T=T, cp_rank=rank, deadline=deadline, at=at, clamp=clamp)
        out[kind] = (saved, b_peak)
    return out


def end_bytes(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, B: int, T: int,
              deadline: float | None = None, at: int | None = None,
              clamp: bool = True) -> dict[str, tuple[Any, Any]]:
    """``{"embed": (saved, b_peak), "head": (saved, b_peak)}``: the first stage's embedding piece and the last
    stage's head piece (the LM head + MTP cross-entropy in token chunks, the MTP layer) as :func:`trace_chunk`
    composes them at ``B x T`` tokens, the head on the CP rank :func:`mixer_bytes` reads (same fits, same ``cache``
    entries). The head's MTP layer keeps a mixer's and an FFN's worth for every micro-batch in flight on the last
    stage: the bound's term for it (``search.memory_bound.static_memory_lower_bound``)."""
    L = cfg.model.num_hidden_layers
    rank = most_keys_rank(cfg)
    moe_chunk = cfg.model.moe_token_chunk if cfg.model.num_experts > 0 else 0
    e = trace_piece(cfg, model, fake, cache, ("embed",), 0, 0, True, False, B=B, T=T, deadline=deadline, at=at,
                    clamp=clamp)
    h = trace_piece(cfg, model, fake, cache, ("head",), L, L, False, True, None, (CE_CHUNK_TOKENS, moe_chunk), "mla",
                    B=B, T=T, cp_rank=rank, deadline=deadline, at=at, clamp=clamp)
    return {"embed": (e[0], e[2]), "head": (h[0], h[2])}


def ffn_bytes(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, B: int, T: int,
              deadline: float | None = None, at: int | None = None, clamp: bool = True) -> dict[bool, tuple[Any, Any]]:
    """``{is_moe: (saved, b_peak)}``: :func:`ffn_saved_bytes` and the FFN sublayer's backward peak (same pieces):
    under sublayer recomputation the MoE's recomputed route rows, what its backward holds beyond its input."""
    reps = piece_layers(cfg)
    moe_chunk = cfg.model.moe_token_chunk if cfg.model.num_experts > 0 else 0
    out = {}
    for moe in sorted({k[1] for k in reps if k[0] == "ffn"}):
        i = reps[("ffn", moe)]
        y = trace_piece(cfg, model, fake, cache, ("ffn", moe), i, i + 1, False, False, "ffn",
                        (moe_chunk,) if moe else (), B=B, T=T, deadline=deadline, at=at, clamp=clamp)
        out[moe] = (y[0], y[2])
    return out


def piece_triples(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, B: int, T: int,
                  deadline: float | None = None, at: int | None = None, clamp: bool = True,
                  exact: bool = False) -> dict[tuple, tuple[Any, Any, Any]]:
    """``{piece key: (saved, f_peak, b_peak)}`` of every piece a chunk of ``cfg`` composes under sublayer pieces
    -- ``("mixer", kind)``, ``("ffn", is_moe)``, ``("embed",)``, ``("head",)`` -- the very ones
    :func:`mixer_bytes`, :func:`ffn_bytes` and :func:`end_bytes` read (same cache entries): what the planner's
    upper bound composes a chunk from. ``exact``: each traced once at ``B x T`` tokens instead (short rows,
    where the estimator traces whole chunks: cheaper than the fits' 1K-4K tokens)."""
    reps = piece_layers(cfg)
    rank = most_keys_rank(cfg)
    L = cfg.model.num_hidden_layers
    moe_chunk = cfg.model.moe_token_chunk if cfg.model.num_experts > 0 else 0
    kw: dict[str, Any] = {"B": B, "T": T, "deadline": deadline, "at": at, "clamp": clamp,
                          "tokens": (B * T,) if exact else None}
    out: dict[tuple, tuple[Any, Any, Any]] = {}
    for kind in sorted({k[1] for k in reps if k[0] == "mixer"}):
        i = reps[("mixer", kind)]
        out[("mixer", kind)] = trace_piece(cfg, model, fake, cache, ("mixer", kind), i, i + 1, False, False, "mixer",
                                           (), kind, cp_rank=rank, **kw)
    for moe in sorted({k[1] for k in reps if k[0] == "ffn"}):
        i = reps[("ffn", moe)]
        out[("ffn", moe)] = trace_piece(cfg, model, fake, cache, ("ffn", moe), i, i + 1, False, False, "ffn",
                                        (moe_chunk,) if moe else (), **kw)
    out[("embed",)] = trace_piece(cfg, model, fake, cache, ("embed",), 0, 0, True, False, **kw)
    out[("head",)] = trace_piece(cfg, model, fake, cache, ("head",), L, L, False, True, None,
                                 (CE_CHUNK_TOKENS, moe_chunk), "mla", cp_rank=rank, **kw)
    return out
