"""The composed pieces of a chunk (the embedding, each layer signature or sublayer, the head + MTP): which layer
stands for each, what their bytes depend on (and so how they are cached), and each piece's fitted trace."""
from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.model.moe import LatentMoE
from k3train.planning.fakerun.synthetic import trace_batch
from k3train.planning.memory.fit import COMPOSE_TOKENS, KDA_COMPOSE_TOKENS, piece_tokens, poly, quadratic_fit
from k3train.planning.memory.limits import check_deadline
from k3train.planning.memory.media import MediaCase
from k3train.planning.memory.trace import trace_range
from parallel.pipeline.stage import recompute_unit


def layer_signature(cfg: Config, i: int) -> tuple:
    """Layers with equal signatures hold equal bytes (up to the AttnRes source count: the one with the most
    sources is traced for all, an upper bound)."""
    m, bs = cfg.model, cfg.model.attn_res_block_size
    return (m.layer_kind(i), m.is_moe_layer(i), i % bs == 0, (i + 1) % bs == 0)


def mla_key_segments(cfg: Config, cp_rank: int) -> int:
    """CP segments of keys an MLA layer of ``cp_rank`` attends over (kcp/mla_cp.py): its causal prefix ``r + 1``,
    or under ``parallel.mla_cp_balance`` ``max(r, cp - 1 - r) + 1`` (its own and its partner's queries' prefix)."""
    C = cfg.parallel.cp
    if C > 1 and cfg.parallel.mla_cp_balance:
        return max(cp_rank, C - 1 - cp_rank) + 1
    return cp_rank + 1


def piece_layers(cfg: Config) -> dict[tuple, int]:
    """The layer traced for each composed piece: the deepest layer of each signature (:func:`layer_signature`)
    and, under sublayer recomputation, of each token-mixer kind ``("mixer", kind)`` and FFN kind ``("ffn",
    is_moe)`` (the most AttnRes sources: the most bytes)."""
    reps: dict[tuple, int] = {}
    for i in range(cfg.model.num_hidden_layers):
        sig = layer_signature(cfg, i)
        reps[sig] = reps[("mixer", sig[0])] = reps[("ffn", sig[1])] = i
    return reps


def most_keys_rank(cfg: Config) -> int:
    """The CP rank whose MLA attends over the most key segments (:func:`mla_key_segments`): rank 0 under the
    query balance, else the last."""
    C = cfg.parallel.cp
    return 0 if C == 1 or cfg.parallel.mla_cp_balance else C - 1


def piece_depends_on_cp(cfg: Config, key: tuple, media: MediaCase | None) -> bool:
    """Whether a composed piece's bytes depend on the CP size (and so are traced, and cached, per cp): a token
    mixer (KDA: the KCP pairs of the whole group are gathered and folded; MLA: its keys are the CP rank's key
    segments) and the head (the MTP layer's MLA) do; an FFN does not -- ``K3Layer.run_ffn`` takes no sequence
    layout, so under CP it runs the same ops on the same ``[B, T, d]`` state -- nor does the embedding, unless a
    vision model's first stage encodes media (their placement is per row of ``cp x T`` tokens)."""
    if key[0] == "ffn":
        return False
    if key == ("embed",):
        return bool(cfg.vision.enabled) and (media or MediaCase()).resolved(cfg).source != "none"
    return True


def piece_local_experts(model: nn.Module, a: int, b: int, last: bool, sub: str | None) -> int:
    """The local experts of the LatentMoEs a piece runs (layers ``[a, b)``, or sublayer ``sub`` of layer ``a``;
    the MTP layer with the head): what its traced bytes depend on besides the tokens (:func:`trace_piece`); 0 for
    a piece without routed experts."""
    mods = [] if sub == "mixer" else [model.layers[str(i)] for i in range(a, b)]
    if last and getattr(model, "mtp", None) is not None:
        mods.append(model.mtp)
    return max((m.experts.num_experts for mod in mods for m in mod.modules() if isinstance(m, LatentMoE)),
               default=0)


def _local_experts(model: nn.Module, cache: dict, a: int, b: int, last: bool, sub: str | None) -> int:
    """:func:`piece_local_experts`, kept in ``cache`` for a model that says its expert-parallel size without being
    built (``lazy_ep``: the planner's :class:`~k3train.planning.memory.cache.LazyModel`; a piece found in the
    cache then needs no model)."""
    ep = getattr(model, "lazy_ep", None)
    if ep is None:
        return piece_local_experts(model, a, b, last, sub)
    key = ("local experts", ep, a, b, last, sub)
    if key not in cache:
        cache[key] = piece_local_experts(model, a, b, last, sub)
    return cache[key]


def trace_piece(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, key: tuple, a: int, b: int,
                fst: bool, lst: bool, sub: str | None = None, chunks: tuple[int, ...] = (), kind: str = "", *,
                B: int, T: int, cp_rank: int = 0, media: MediaCase | None = None,
                deadline: float | None = None, at: int | None = None, clamp: bool = True,
                tokens: tuple[int, ...] | None = None) -> tuple[Any, ...]:
    """``(saved, f_peak, b_peak)`` of one composed piece (layers ``[a, b)``, or sublayer ``sub`` of layer ``a``;
    see :func:`trace_range`) for a micro-batch of ``B`` rows of ``T`` tokens on CP rank ``cp_rank``: each byte count
    fitted exactly through traces at :func:`piece_tokens`' token counts and evaluated at ``B x T``; ``cache``
    holds the fits by what the traces depend on (the comment on ``TRACE_BUDGET`` in
    :mod:`k3train.planning.memory.compose`). ``at``: the same fits (those of ``B x T``) evaluated at ``at``
    tokens instead (``at=0``: their constant terms, what the planner's bounds scale a row's bytes by);
    ``clamp=False``: as floats, not rounded to bytes >= 0; ``tokens``: traced at these token counts instead of
    :func:`piece_tokens`' (one: ``B x T`` itself, the planner's upper bound for short rows)."""
    recompute = cfg.parallel.recompute
    unit = recompute_unit(cfg, recompute)
    chunk_rc = recompute and unit is None  # the whole chunk one region: pieces traced without recomputation
    C = cfg.parallel.cp if piece_depends_on_cp(cfg, key, media) else 1
    # the fits depend on the rows, the CP size and balance (pieces that read the sequence layout), the dtype, the
    # recompute unit, the token counts traced; the encoder's on the media and block recompute; a piece that runs a
    # LatentMoE on its local expert count (:func:`piece_local_experts`: the backward computes one expert weight's
    # gradient for all local experts before it accumulates into ``.grad``, at K3 width 22 MB an expert -- 2.3 GiB at
    # ep 8, 18 GiB at ep 1), so per ep; the route rows are not (every N*k row is computed on the rank's shard,
    # ``_ShardDispatcher``)
    mla = kind == "mla"  # its traces on short documents, at CP ranks 0 and 1 (its keys depend on the rank)
    bk = cfg.model.mla_block_size
    base = (KDA_COMPOSE_TOKENS if kind == "kda" else (bk * B, 2 * bk * B, 4 * bk * B) if mla
            else COMPOSE_TOKENS)
    pts = tokens or piece_tokens(B * T, list(chunks), base)
    if C > CP_TRACED_MAX and key != ("embed",):
        line = _on_cp_line(cfg, model, fake, cache, key, a, b, fst, lst, sub, chunks, kind, B=B, T=T,
                           cp_rank=cp_rank, media=media, deadline=deadline, at=at, clamp=clamp, tokens=tokens)
        if line is not None:
            return _bytes(line, clamp)
    ck = key + (B, C, cfg.train.dtype, cfg.parallel.mla_cp_balance if C > 1 else None,
                None if chunk_rc else unit, pts, _local_experts(model, cache, a, b, lst, sub)) + (
                    (media, cfg.parallel.recompute) if key == ("embed",) else ())
    if ck not in cache:
        fits = []

        def traced(r: int, t: int) -> tuple[int, int, int]:
            check_deadline(deadline)
            dl = bk if mla and (t // B) % bk == 0 else 0
            row = [trace_batch(cfg, B, t // B, rr, dl)[0] for rr in range(C)]  # synthetic CP rows
            return trace_range(cfg, model, a, b, fst, lst, row[r], fake, recompute and not chunk_rc,
                               r if C > 1 else None, row, media, sub)

        ys = [traced(0, t) for t in pts]
        fits.append([quadratic_fit(pts, [y[k] for y in ys]) for k in range(3)])
        # only the MLA's keys depend on the CP rank (the KCP pairs are the whole group's on every rank); what a key
        # segment more holds (the latents, their ids, the latent gradient) is proportional to the tokens: the
        # rank-1 difference is taken at the smallest token count and scaled
        if C > 1 and mla:
            y1 = traced(1, pts[0])
            fits.append([(f[0], f[1] + (y1[k] - ys[0][k]) / pts[0], f[2]) for k, f in enumerate(fits[0])])
        cache[ck] = fits
    fits = cache[ck]
    t = B * T if at is None else at
    vals = [poly(f, t) for f in fits[0]]
    if len(fits) > 1:
        nk = [mla_key_segments(cfg, r) for r in range(min(C, 2))]
        if nk[1] != nk[0]:
            w = (mla_key_segments(cfg, cp_rank) - nk[0]) / (nk[1] - nk[0])
            vals = [y0 + w * (poly(f1, t) - y0) for y0, f1 in zip(vals, fits[1])]
        else:  # cp = 2 balanced: both ranks attend over both segments
            vals = [max(y0, poly(f1, t)) for y0, f1 in zip(vals, fits[1])]
    return _bytes(vals, clamp)


def _bytes(vals: Any, clamp: bool) -> tuple[Any, ...]:
    """Byte counts (rounded, >= 0) or, unclamped, the values as they are."""
    return tuple(max(0, int(round(y))) for y in vals) if clamp else tuple(float(y) for y in vals)


# Above this CP size a cp-dependent piece (a token mixer, a layer, the head) is not traced at its cp: what it holds is
# affine in the CP size at a fixed segment length -- the KDA pairs of the whole group are gathered and kept ([cp, B,
# H, dk, dk+dv]), an MLA rank's keys are its key segments (``mla_key_segments``: cp - r under balance) -- so it is
# traced at CP_LINE (CP ranks 0 and 1), the three points checked to lie on one line, and extended on it. The traces
# at a large cp cost what the cp costs (the KDA fold's backward walks the cp ranks one by one on fake tensors, an
# MLA rank's blockwise attention its key segments: 21 s a trace at cp 64); these cost what cp 4 + 6 + 8 do, once for
# every cp (K3's MLA mixer at 1M: 86 s at (4, 8, 16)).
CP_TRACED_MAX = 16


CP_LINE = (4, 6, 8)


def _on_cp_line(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, key: tuple, a: int, b: int,
                fst: bool, lst: bool, sub: str | None, chunks: tuple[int, ...], kind: str, *, B: int, T: int,
                cp_rank: int, media: MediaCase | None, deadline: float | None,
                at: int | None = None, clamp: bool = True,
                tokens: tuple[int, ...] | None = None) -> tuple[float, ...] | None:
    """:func:`trace_piece` at ``cfg.parallel.cp`` from its values at CP_LINE (see above): each byte count of CP
    ranks 0 and 1 extended on its line in the cp, rank ``cp_rank`` placed between them by its MLA key segments as
    :func:`trace_piece` does; None when the points are not on one line (then the piece is traced at its cp)."""
    C = cfg.parallel.cp
    ranks = (0, 1) if kind == "mla" else (0,)
    vals: dict[int, list[float]] = {}
    for r in ranks:
        pts = []
        for c in CP_LINE:
            cc = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=c))
            pts.append(trace_piece(cc, model, fake, cache, key, a, b, fst, lst, sub, chunks, kind, B=B, T=T,
                                   cp_rank=r, media=media, deadline=deadline, at=at, clamp=clamp, tokens=tokens))
        (c0, c1, c2), line = CP_LINE, []
        for y0, y1, y2 in zip(*pts):
            slope = (y2 - y1) / (c2 - c1)
            if abs((y1 - y0) - slope * (c1 - c0)) > max(64, 1e-6 * abs(y2)):  # rounding of the fits: bytes
                return None
            line.append(y2 + slope * (C - c2))
        vals[r] = line
    out = vals[0]
    if kind == "mla":
        nk = [mla_key_segments(cfg, r) for r in (0, 1)]
        w = (mla_key_segments(cfg, cp_rank) - nk[0]) / (nk[1] - nk[0]) if nk[1] != nk[0] else 0.0
        out = [y0 + w * (y1 - y0) for y0, y1 in zip(vals[0], vals[1])]
    return tuple(out)
