"""An upper bound on a layout's worst rank's peak without its estimate: a layout that fits on it with a margin is
ranked untraced (the chosen layout's exact peak is traced alone, ``tools/plan.py --exact-memory`` traces all).

Per pipeline rank, everything the estimate adds, each at its largest: the parameters and gradients at 4 bytes an
element (at least their dtype's), the model's buffers, the optimizer state of every parameter of the stage (no
ZeRO share counted: the owners' shares are the estimator's), the EP token buffers and MoonEP's replica pool (twice
under F/B pairing), the media pixels; the activations of the forwards in flight at once (the forwards the schedule
runs before the rank's first backward, one more for a pair) each holding the largest chunk's saved bytes and
received payload and block-cache gradients, plus the largest backward's (or forward's) peak with its incoming
gradient and MoonEP's replica gradients; the optimizer step's largest update transient over every parameter of the
model (unsharded) and the reduction's bucket. The chunk's bytes are composed from the one-row pieces of
:mod:`~k3train.planning.search.piece_bounds`, scaled up to the micro-batch's rows
(:func:`~k3train.planning.search.piece_bounds.rows_upper`) and, where the estimator traces whole chunks of the
run's data (documents padded to KDA chunks, every layer's own AttnRes sources), traced at the row's own length
and taken ``WHOLE_MARGIN`` times;
under layer recomputation (no pieces) there is no upper bound.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

from k3train.model.model import K3Model
from k3train.planning.dtypes import dtype_bytes, train_dtype
from k3train.planning.memory.buffers import ep_buffers, plan_bytes
from k3train.planning.memory.compose import compose, whole_traces
from k3train.planning.memory.media import MediaCase, media_pixel_bytes
from k3train.planning.memory.optimizer import optimizer_transient
from k3train.planning.memory.piece_bytes import piece_triples
from k3train.planning.programs import forwards_before_first_backward, pairs_actions
from k3train.planning.search.piece_bounds import PieceBounds, piece_mode, rows_upper
from k3train.planning.search.rows import Row
from parallel.pipeline.attnres_comm import AttnResCommPlan

WHOLE_MARGIN = 2.0  # whole-chunk traces on the run's data against the composed one-row pieces (module docstring)
BUCKET = 64 * 2**20  # the ZeRO reduction's flat bucket copy at most (memory.buffers.bucket_transient)


class MemoryUpper:
    """Upper bounds on layouts' peaks (:meth:`of`), from the pieces :class:`PieceBounds` traces (memoised)."""

    def __init__(self, bounds: PieceBounds) -> None:
        self.b = bounds
        self.memo: dict[Any, Any] = {}
        # one row's pieces (and their fits' constants) per row length, cp, ep: fitted, or traced at the row's length
        self.triples: dict[bool, dict[tuple, Any]] = {False: {}, True: {}}

    def of(self, r: Row, deadline: float | None) -> int | None:
        """``r``'s upper bound (None: layer recomputation, or the deadline passed before its pieces were traced)."""
        mode = piece_mode(r.cfg, r.layout.recompute)
        if mode == "layer":
            return None
        pieces = self._pieces(r, deadline)
        if pieces is None:
            return None
        L, cfg = r.layout, r.cfg
        part = self.b.val.partition(cfg)
        paired = pairs_actions(cfg)
        flight = forwards_before_first_backward(L.schedule, L.pp, L.vpp, cfg.train.grad_accum_steps, paired)
        fixed = self._fixed(r, paired)
        best = 0
        for rank in range(L.pp):
            d, e, _ = self.b.facts.stage_numel(part, rank, L.ep)
            n = d + e
            weights = n * max(4, dtype_bytes(cfg)) * 2 + n * 16  # params, grads; optimizer state (<= 16 B each)
            act = self._activations(r, part, rank, pieces, len(flight[rank]) - 1 + 1 + int(paired))
            best = max(best, int(weights + fixed + act))
        return best

    def _fixed(self, r: Row, paired: bool) -> int:
        """What every rank of ``r`` holds at most beside its stage's weights and activations: the buffers, the
        EP buffers (twice paired), the media pixels, the largest update's transient, the bucket."""
        cfg, L = r.cfg, r.layout
        key = ("fixed", L.ep, L.mbs, L.cp, L.moonep, paired, L.dp)
        if key not in self.memo:
            meta = self._meta(cfg)
            bufs = sum(b.numel() * max(4, b.element_size()) for b in meta.buffers())
            ep_persist, replica, _ = ep_buffers(cfg, meta, L.ep, L.mbs, cfg.train.seq_len // L.cp)
            media = media_pixel_bytes(cfg, None, MediaCase().resolved(cfg))
            ns = optimizer_transient(cfg, self.b.facts.infos, {i.index for i in self.b.facts.infos},
                                     self.b.cache.fake, self.b.cache.ns)
            self.memo[key] = (bufs + ep_persist * (2 if paired else 1) + media + ns + BUCKET, replica)
        return self.memo[key][0]

    def _meta(self, cfg: Any) -> Any:
        if "meta" not in self.memo:
            with torch.device("meta"):
                self.memo["meta"] = K3Model(cfg.model, cfg.vision)
        return self.memo["meta"]

    def _pieces(self, r: Row, deadline: float | None) -> dict[tuple, tuple] | None:
        """The pieces' ``(saved, f_peak, b_peak)`` for ``r``'s micro-batch, scaled up from one row (x
        ``WHOLE_MARGIN`` where the estimator traces whole chunks)."""
        whole = whole_traces(r.cfg, r.layout.mbs, r.cfg.train.seq_len // r.layout.cp)
        fn = partial(piece_triples, exact=True) if whole else piece_triples
        got = self.b.per_cp(r, fn, self.triples[whole], deadline, by_ep=True, whole=True)
        if got is None:
            return None
        up = rows_upper(*got, r.layout.mbs)
        if whole:
            up = {k: tuple(int(WHOLE_MARGIN * x) for x in v) for k, v in up.items()}
        return up

    def _activations(self, r: Row, part: Any, rank: int, pieces: dict[tuple, tuple], n_fwd: int) -> int:
        """Rank ``rank``'s activations at most: ``n_fwd`` forwards in flight each holding the largest local chunk's
        saved bytes, received payload and block-cache gradients, plus the largest compute's peak with its incoming
        gradient, a send's payload and MoonEP's replica gradients (3 x one MoE layer's replicas)."""
        cfg, L = r.cfg, r.layout
        T = cfg.train.seq_len // L.cp
        plan = AttnResCommPlan(part, cfg.parallel.attnres_comm) if L.pp > 1 else None
        dtype = train_dtype(cfg)
        tensor = L.mbs * T * cfg.model.hidden_size * dtype_bytes(cfg)
        replica = self.memo[("fixed", L.ep, L.mbs, L.cp, L.moonep, pairs_actions(cfg), L.dp)][1]
        held = peak = 0
        for v in part.local_stages(rank):
            s, e = part.bounds[v]
            seq = [pieces[("embed",)]] if v == 0 else []
            for i in range(s, e):
                seq += [pieces[("mixer", cfg.model.layer_kind(i))], pieces[("ffn", cfg.model.is_moe_layer(i))]]
            if v == part.num_stages - 1:
                seq.append(pieces[("head",)])
            saved, f, b = compose(seq)
            if L.recompute and piece_mode(cfg, True) is None:  # a chunk recomputed whole keeps its input only
                saved = 0
            recv = plan_bytes(plan, v - 1, L.mbs, T, cfg.model.hidden_size, dtype) if v > 0 else 0
            grad = plan_bytes(plan, v, L.mbs, T, cfg.model.hidden_size, dtype) if v < part.num_stages - 1 else 0
            cached = plan.known_blocks(v) * tensor if plan is not None else 0
            moe = any(cfg.model.is_moe_layer(i) for i in range(s, e))
            held = max(held, saved + recv + cached)
            peak = max(peak, max(f, b) + grad + recv + (3 * replica if moe else 0))
        return n_fwd * held + peak
