"""The bound phase: every layout's static memory bound (:mod:`k3train.planning.search.memory_bound`), memoised by
what it reads, and its refinements with the traced pieces' bytes (:mod:`k3train.planning.memory.piece_bytes`).

The pieces are traced on ONE row of ``seq_len / cp`` tokens (once per row length for every micro-batch size) and
scaled to the micro-batch's ``B`` rows: a piece's bytes are a constant per micro-batch (the fit's constant term:
``trace_piece(..., at=0)``) plus what each row adds, so ``B`` rows hold ``B x`` one row's less ``B - 1`` times a
positive constant (:func:`rows_lower`); a backward's peak at least one row's and at least the rows' saved bytes.
Where the estimator traces whole chunks (short rows) only the FFN pieces count (a whole trace holds every FFN's
saved tensors; the composed token mixers, each traced at the deepest layer of its kind, may hold more). Under no recomputation or chunk recomputation the pieces are traced without
recomputation (a recomputed chunk holds its pieces' activations at once in its backward), under sublayer
recomputation with it; layer recomputation keeps the hidden-state counts.

Within the bound on one hidden state per FFN, each FFN counts its traced piece's bytes instead (once per row
length, every cp alike); when a layout first comes up in the search, each token mixer counts its piece's bytes
(traced per cp, for the cps of the layouts that come up), with the first backward's chunk composed as the
estimator composes it; when it comes up for a trace, the embedding and head pieces too, at its cp and ep (the
very pieces its estimate composes). Every piece is traced into
the planner's :class:`~k3train.planning.memory.cache.EstimateCache` (the estimates reuse them; with a store, kept
across plans).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from k3train.planning.memory.cache import EstimateCache
from k3train.planning.memory.compose import whole_traces
from k3train.planning.memory.limits import TraceDeadline
from k3train.planning.memory.piece_bytes import end_bytes, ffn_bytes, mixer_bytes
from k3train.planning.programs import forwards_before_first_backward, pairs_actions
from k3train.planning.search.layouts import Validator, layout_config
from k3train.planning.search.memory_bound import static_memory_lower_bound
from k3train.planning.search.rows import Row
from k3train.planning.step_time.facts import ParamFacts


def piece_mode(cfg: Any, recompute: bool) -> str | None:
    """How a layout's pieces are traced for its bound: ``"sublayer"`` (under sublayer recomputation), ``None``
    (without recomputation: no recomputation, or a chunk recomputed whole) or ``"layer"`` (no pieces)."""
    gran = cfg.parallel.recompute_granularity if recompute else None
    return "sublayer" if gran == "sublayer" else "layer" if gran == "layer" else None


def rows_lower(one: dict[Any, Any], const: dict[Any, Any], B: int) -> dict[Any, Any]:
    """A lower bound on ``B`` rows' piece bytes from one row's (``one``) and the fits' constants (``const``):
    saved ``B s - (B - 1) max(s0, 0)``; a peak at least one row's and at least the saved bytes (module docstring).
    Values: a byte count, or ``(saved, peak)``."""
    out = {}
    for k, v in one.items():
        if isinstance(v, tuple):
            s = int(B * v[0] - (B - 1) * max(const[k][0], 0.0))
            out[k] = (s, max(int(v[1]), s))
        else:
            out[k] = int(B * v - (B - 1) * max(const[k], 0.0))
    return out


def rows_upper(one: dict[Any, Any], const: dict[Any, Any], B: int) -> dict[Any, Any]:
    """An upper bound on ``B`` rows' piece bytes: each value ``B y + (B - 1) max(-y0, 0)`` (a constant per
    micro-batch plus what each row adds; a token-chunked module's transient holds no more than its rows')."""
    def up(y: float, y0: float) -> int:
        return int(B * y + (B - 1) * max(-y0, 0.0)) + 1

    return {k: (tuple(up(y, y0) for y, y0 in zip(v, const[k])) if isinstance(v, tuple) else up(v, const[k]))
            for k, v in one.items()}


class PieceBounds:
    """The static memory bounds of a plan's rows (``bound``: by ``Row.bound_key``) and what refines them: the
    traced FFN, token-mixer and end pieces (memoised per row length, cp, piece mode and, for the end pieces, ep),
    and the bounds still to refine with the mixers (``mixer_refine``) and with the end pieces (``refine``)."""

    def __init__(self, cache: EstimateCache, facts: ParamFacts, val: Validator, hbm: float, t_end: float,
                 ep_ends: tuple[int, int]) -> None:
        self.cache, self.facts, self.val, self.hbm, self.t_end = cache, facts, val, hbm, t_end
        self.ep_ends = ep_ends  # the space's smallest and largest ep: what the FFN pieces are traced at
        self.bound: dict[tuple, int] = {}
        self.flight: dict[tuple, list[list[int]]] = {}
        # one row's pieces and their fits' constants, None once the plan's time is spent
        self.ffn: dict[tuple, tuple[dict, dict] | None] = {}  # (row tokens, mode)
        self.mixer: dict[tuple, tuple[dict, dict] | None] = {}  # (row tokens, cp, mode)
        self.ends: dict[tuple, tuple[dict, dict] | None] = {}  # (row tokens, cp, mode, ep)
        self.missing: set[tuple] = set()  # (fn, key) of pieces a probe found untraced (``per_cp``)
        self.mixer_refine: dict[tuple, tuple] = {}  # bound key -> what the bound with the token mixers' pieces reads
        self.refine: dict[tuple, tuple] = {}  # bound key -> what the bound with the end pieces reads

    def static(self, r: Row) -> None:
        """``r``'s static memory bound (``r.mem_bound``, ``r.bound_key``), with its FFN pieces' bytes where they
        apply; over the device: too big (``skipped: 'bound'``)."""
        part = self.val.partition(r.cfg)
        L = r.layout
        tokens = L.mbs * r.cfg.train.seq_len // L.cp
        rc = r.cfg.parallel.recompute_granularity if L.recompute else None
        n_mb = r.cfg.train.global_batch_size // (L.dp * L.mbs)
        paired = pairs_actions(r.cfg)
        kb = (id(part), L.pp, L.dp * L.cp, L.ep, L.zero, L.moonep, tokens, L.mbs, rc, L.schedule, n_mb, paired)
        if kb not in self.bound:
            sk = (L.schedule, L.pp, L.vpp, n_mb, paired)
            if sk not in self.flight:
                self.flight[sk] = forwards_before_first_backward(*sk)
            args = (self.facts, r.cfg, part, L.pp, L.dp * L.cp, L.ep, L.zero, L.moonep, tokens, rc, self.flight[sk])
            self.bound[kb] = static_memory_lower_bound(*args)
            if self.bound[kb] <= self.hbm and piece_mode(r.cfg, L.recompute) != "layer":
                # count the FFNs' traced bytes (module docstring); the token mixers' pieces (per cp) when the
                # layout first comes up
                ffn = self.ffn_rows(r)
                if ffn is not None:
                    if rc is None or rc == "sublayer":
                        self.bound[kb] = static_memory_lower_bound(*args, ffn_saved=ffn)
                    self.mixer_refine[kb] = (args, ffn)
        r.bound_key = kb
        r.mem_bound = self.bound[kb]
        if r.mem_bound > self.hbm:
            r.fits, r.skipped = False, "bound"

    def with_mixers(self, r: Row, trace: bool = True) -> None:
        """First up: the bound with the token mixers' traced pieces at its cp, the first backward's chunk composed
        as the estimator composes it -- traced for the cps of the layouts that come up, not for every cp (not
        ``trace``: only with pieces traced already, in this plan or in the store; else left for later)."""
        if r.bound_key not in self.mixer_refine:
            return
        mix = self.per_cp(r, mixer_bytes, self.mixer, self.t_end, probe=not trace)
        if mix is None and not trace:
            return
        args, ffn = self.mixer_refine.pop(r.bound_key)
        if mix is not None:
            mix = rows_lower(*mix, r.layout.mbs)
            self.bound[r.bound_key] = max(self.bound[r.bound_key],
                                          static_memory_lower_bound(*args, ffn_saved=ffn, mixer=mix))
            self.refine[r.bound_key] = (args, ffn, mix)  # the end pieces: when it is about to be traced

    def with_ends(self, r: Row, ends: tuple[dict, dict]) -> None:
        """The bound with the first and last stage's traced pieces at the layout's ep (one row's and their
        constants)."""
        args, ffn, mix = self.refine.pop(r.bound_key)
        self.bound[r.bound_key] = r.mem_bound = max(
            self.bound[r.bound_key],
            static_memory_lower_bound(*args, ffn_saved=ffn, mixer=mix, ends=rows_lower(*ends, r.layout.mbs)))

    def with_known_ends(self, r: Row) -> None:
        """The end pieces at ``r``'s cp and ep traced already: the bound with them before a simulation."""
        ends = self.ends.get(self._row_key(r) + (r.layout.cp, piece_mode(r.cfg, r.layout.recompute), r.layout.ep))
        if ends is not None and r.bound_key in self.refine:
            self.with_ends(r, ends)

    def with_traced_ends(self, r: Row, deadline: float | None) -> None:
        """The end pieces traced at ``r``'s cp and ep (for the estimate anyway: the same cache entries): over the
        device, too big without the rest. :class:`TraceDeadline` once ``deadline`` passes."""
        ends = self.per_cp(r, end_bytes, self.ends, deadline, by_ep=True)
        if ends is None:
            raise TraceDeadline()
        self.with_ends(r, ends)

    def ffn_rows(self, r: Row) -> dict[bool, tuple[int, int]] | None:
        """The FFN pieces' ``(saved, b_peak)`` for ``r``'s micro-batch (:func:`rows_lower` of one row's), at most
        what they are at any ep of the space: the smaller of their values at the smallest and the largest ep
        (``ep_ends``). What a MoE FFN saves is a few bookkeeping bytes per local expert (fewer at a larger ep)
        plus bytes per route row that are the same at every ep > 1, so no ep between holds less
        (``tests/planning/test_memory_compose.py``); two traces instead of one per ep. None once the plan's time is
        spent."""
        mode = piece_mode(r.cfg, r.layout.recompute)
        key = self._row_key(r) + (mode,)
        if key not in self.ffn:
            vals = [self.traced(r, ffn_bytes, self.t_end, ep) for ep in sorted(set(self.ep_ends))]
            self.ffn[key] = None if any(v is None for v in vals) else _at_most(vals)
        got = self.ffn[key]
        return None if got is None else rows_lower(*got, r.layout.mbs)

    def per_cp(self, r: Row, fn: Any, memo: dict[tuple, Any], t_end: float | None, by_ep: bool = False,
               ep: int | None = None, whole: bool = False, probe: bool = False) -> tuple[dict, dict] | None:
        """``fn`` (:func:`mixer_bytes` or :func:`end_bytes`) for one row of ``r``'s micro-batch at its cp (None
        once the plan's time is spent; for layer recomputation, whose bound reads no pieces; and, unless
        ``whole``, where the estimator traces whole chunks: the composed pieces (each layer's traced at the
        deepest layer of its kind, with the most AttnRes sources) may hold more than a whole trace);
        ``by_ep``: also per ep (``ep``, default ``r``'s: the head's MTP layer runs the local experts);
        ``probe``: only if nothing needs a trace (the pieces in the cache or the store), else None, not kept."""
        mode = piece_mode(r.cfg, r.layout.recompute)
        if mode == "layer" or (not whole and whole_traces(r.cfg, r.layout.mbs, r.cfg.train.seq_len // r.layout.cp)):
            return None
        ep = ep or r.layout.ep
        key = self._row_key(r) + (r.layout.cp, mode) + ((ep,) if by_ep else ())
        if key not in memo:
            if probe and (fn, key) in self.missing:
                return None
            got = self.traced(r, fn, 0.0 if probe else t_end, ep)  # a deadline already past: no new trace
            if probe and got is None:
                self.missing.add((fn, key))
                return None
            memo[key] = got
        return memo[key]

    def traced(self, r: Row, fn: Any, t_end: float | None, ep: int) -> tuple[dict, dict] | None:
        """``fn(cfg, full model, fake mode, piece cache, 1, T, deadline)`` for one row of ``r``'s (``T = seq_len /
        cp`` tokens) and its fits' constants (``at=0``), on the :class:`EstimateCache`'s fake full model of ``ep``
        (built only if a piece is not in the cache), under ``r``'s piece mode; None when the deadline passes."""
        c, T = self.cache, self._row_key(r)[0]
        cfg = r.cfg if not r.layout.recompute or piece_mode(r.cfg, True) == "sublayer" else \
            layout_config(r.cfg, replace(r.layout, recompute=False))  # chunk recomputation: pieces without it
        model = c.lazy_full(cfg, ep)
        try:
            return (fn(cfg, model, c.fake, c.pieces, 1, T, t_end),
                    fn(cfg, model, c.fake, c.pieces, 1, T, t_end, at=0, clamp=False))
        except TraceDeadline:
            return None

    @staticmethod
    def _row_key(r: Row) -> tuple[int]:
        return (r.cfg.train.seq_len // r.layout.cp,)

    def ffn_line(self) -> str | None:
        """The FFN bytes traced for the bound, for the log (None: none traced)."""
        if not self.ffn:
            return None
        return "FFN bytes kept per micro-batch row (traced once for every cp; GiB, dense / MoE): " + "; ".join(
            f"{t} tokens{'' if mode is None else ', ' + mode + ' recompute'}: "
            + ("budget spent" if v is None else " / ".join(f"{v[0][k][0] / 2**30:.2f}" for k in sorted(v[0])))
            for (t, mode), v in sorted(self.ffn.items(), key=lambda x: (x[0][0], str(x[0][1]))))

    def mixer_line(self) -> str | None:
        """The token-mixer bytes traced for the bound, for the log (None: none traced)."""
        if not self.mixer:
            return None
        return ("token-mixer bytes per micro-batch row (saved / backward peak, GiB; at the CP rank with the "
                "most MLA keys): " + "; ".join(
                    f"{t} tokens, cp {cp}{'' if mode is None else ', ' + mode + ' recompute'}: "
                    + ("budget spent" if v is None else ", ".join(
                        f"{k} {v[0][k][0] / 2**30:.2f} / {v[0][k][1] / 2**30:.2f}" for k in sorted(v[0])))
                    for (t, cp, mode), v in sorted(self.mixer.items(), key=lambda x: (x[0][:2], str(x[0][2])))))


def _at_most(vals: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Of several ``(one row, constants)`` pairs, one whose :func:`rows_lower` is at most each of theirs: per key
    the smallest row bytes and the largest constants (elementwise in tuples)."""
    def pick(ds: list[dict[Any, Any]], f: Any) -> dict[Any, Any]:
        return {k: (f(d[k] for d in ds) if not isinstance(ds[0][k], tuple)
                    else tuple(f(x) for x in zip(*(d[k] for d in ds)))) for k in ds[0]}

    return pick([v[0] for v in vals], min), pick([v[1] for v in vals], max)
