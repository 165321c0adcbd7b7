"""The bound phase: every layout's static memory bound (:mod:`k3train.planning.search.memory_bound`), memoised by
what it reads, and its refinements with the traced pieces' bytes (:mod:`k3train.planning.memory.piece_bytes`).

Under sublayer recomputation (or none), within the bound on one hidden state per FFN: each FFN counts its traced
piece's bytes instead (once per row length, every cp alike) -- of ONE row: a micro-batch of several holds at least
what one of its rows holds (the pieces' traces at one row serve every micro-batch size); also where the estimator
traces whole chunks (short rows): a whole trace holds every FFN's saved tensors. Under sublayer recomputation, when
a layout first comes up in the search, each token mixer counts its piece's bytes (traced per cp, for the cps of the
layouts that come up), with the first backward's chunk composed as the estimator composes it; when it comes up for
a trace, the embedding and head pieces too: first at what they hold at the space's smallest and largest ep (traced
once per cp for every ep), then at its own. Every piece is traced into the planner's
:class:`~k3train.planning.memory.cache.EstimateCache` (the estimates reuse them).
"""
from __future__ import annotations

from typing import Any

from k3train.planning.memory.cache import EstimateCache
from k3train.planning.memory.compose import whole_traces
from k3train.planning.memory.limits import TraceDeadline
from k3train.planning.memory.piece_bytes import end_bytes, ffn_saved_bytes, mixer_bytes
from k3train.planning.programs import forwards_before_first_backward, pairs_actions
from k3train.planning.search.layouts import Validator
from k3train.planning.search.memory_bound import static_memory_lower_bound
from k3train.planning.search.rows import Row
from k3train.planning.step_time.facts import ParamFacts


class PieceBounds:
    """The static memory bounds of a plan's rows (``bound``: by ``Row.bound_key``) and what refines them: the
    traced FFN, token-mixer and end pieces (memoised per row length, cp and, for the end pieces, ep), and the
    bounds still to refine with the mixers (``mixer_refine``) and with the end pieces (``refine``)."""

    def __init__(self, cache: EstimateCache, facts: ParamFacts, val: Validator, hbm: float, t_end: float,
                 ep_ends: tuple[int, int]) -> None:
        self.cache, self.facts, self.val, self.hbm, self.t_end = cache, facts, val, hbm, t_end
        self.ep_ends = ep_ends  # the space's smallest and largest ep: what the FFN and end pieces are traced at
        # the bound reads the partition, dp*cp, ep, zero, moonep, tokens, schedule
        self.bound: dict[tuple, int] = {}
        self.flight: dict[tuple, list[list[int]]] = {}
        self.ffn: dict[tuple, dict[bool, int] | None] = {}  # (row tokens, recompute) -> ffn_saved_bytes
        self.mixer: dict[tuple, dict[str, tuple[int, int]] | None] = {}  # (row tokens, cp) -> mixer_bytes
        self.ends: dict[tuple, dict[str, tuple[int, int]] | None] = {}  # (row tokens, cp, ep) -> end_bytes
        self.ends_at_most: dict[tuple, dict[str, tuple[int, int]] | None] = {}  # (row tokens, cp) -> at most any ep's
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
            if self.bound[kb] <= self.hbm and rc in (None, "sublayer"):
                # within the bound on one hidden state per FFN: count the FFN's traced bytes (module docstring);
                # under sublayer recomputation the token mixers' pieces (per cp) when the layout first comes up
                ffn = self.ffn_saved(r)
                if ffn is not None:
                    self.bound[kb] = static_memory_lower_bound(*args, ffn_saved=ffn)
                    if rc == "sublayer":
                        self.mixer_refine[kb] = (args, ffn)
        r.bound_key = kb
        r.mem_bound = self.bound[kb]
        if r.mem_bound > self.hbm:
            r.fits, r.skipped = False, "bound"

    def with_mixers(self, r: Row) -> None:
        """First up: the bound with the token mixers' traced pieces at its cp (a line in the cp above 16), the first
        backward's chunk composed as the estimator composes it -- traced for the cps of the layouts that come up,
        not for every cp of the space."""
        if r.bound_key not in self.mixer_refine:
            return
        args, ffn = self.mixer_refine.pop(r.bound_key)
        mix = self.per_cp(r, mixer_bytes, self.mixer, self.t_end)
        if mix is not None:
            self.bound[r.bound_key] = static_memory_lower_bound(*args, ffn_saved=ffn, mixer=mix)
            self.refine[r.bound_key] = (args, ffn, mix)  # the end pieces: when it is about to be traced

    def with_ends(self, r: Row, ends: dict[str, tuple[int, int]], final: bool = True) -> None:
        """The bound with the first and last stage's traced pieces: ``final`` with those at the layout's ep, else
        with :meth:`ends_low`'s (a bound too, kept where it is over the device)."""
        args, ffn, mix = self.refine[r.bound_key]
        b = static_memory_lower_bound(*args, ffn_saved=ffn, mixer=mix, ends=ends)
        if final or b > self.hbm:
            self.refine.pop(r.bound_key)
            self.bound[r.bound_key] = r.mem_bound = b

    def with_known_ends(self, r: Row) -> None:
        """The end pieces at ``r``'s cp traced already (at the space's end eps, or at its ep): the bound with them
        before a simulation (a fitting layout's AFAB sibling at many micro-batches is far over it, and simulating
        it costs seconds)."""
        T_row = r.cfg.train.seq_len // r.layout.cp
        for ends, final in ((self.ends_at_most.get((1, T_row, r.layout.cp)), False),
                            (self.ends.get((1, T_row, r.layout.cp, r.layout.ep)), True)):
            if ends is not None and r.bound_key in self.refine:
                self.with_ends(r, ends, final)

    def with_traced_ends(self, r: Row, deadline: float | None) -> None:
        """The end pieces traced at ``r``'s cp (for the estimate anyway: the same cache entries): over the device,
        too big without the rest -- first with what they hold at the space's smallest and largest ep (traced once
        per cp for every ep), then at its own. :class:`TraceDeadline` once ``deadline`` passes."""
        low = self.ends_low(r, deadline)
        if low is None:
            raise TraceDeadline()
        self.with_ends(r, low, final=False)
        if r.bound_key in self.refine:
            ends = self.per_cp(r, end_bytes, self.ends, deadline, by_ep=True)
            if ends is None:
                raise TraceDeadline()
            self.with_ends(r, ends)

    def ffn_saved(self, r: Row) -> dict[bool, int] | None:
        """``ffn_saved_bytes`` for one row of ``r``'s micro-batch (``seq_len / cp`` tokens) under
        its recompute setting, at most what it is at any ep of the space: the smaller of its values at the
        smallest and the largest ep (``ep_ends``). What a MoE FFN saves is a few bookkeeping bytes per local
        expert (fewer at a larger ep) plus bytes per route row that are the same at every ep > 1, so no ep between
        holds less (``tests/planning/test_memory_compose.py``); two traces instead of one per ep (each ep's fake
        model and traces cost seconds at K3 width). Traced into the :class:`EstimateCache` (where the estimator
        composes per piece under sublayer recomputation, the estimates reuse them; where it traces whole chunks they
        are a part of what each layer of the trace keeps); None once the plan's time is spent."""
        B, T = 1, r.cfg.train.seq_len // r.layout.cp  # one row (module docstring)
        key = (B, T, r.layout.recompute)
        if key not in self.ffn:
            self.ffn[key] = _smaller([self.traced(r, ffn_saved_bytes, B, T, self.t_end, ep)
                                      for ep in sorted(set(self.ep_ends))])
        return self.ffn[key]

    def ends_low(self, r: Row, t_end: float | None) -> dict[str, tuple[int, int]] | None:
        """``end_bytes`` at ``r``'s cp, at most what they are at any ep of the space: the smaller of their
        values at its smallest and largest ep (the head's MTP layer runs the local experts: its backward holds a
        weight gradient per local expert, fewer at a larger ep; see :meth:`ffn_saved`) -- two traces per cp
        instead of one per ep, for the bound of every layout at that cp."""
        key = (1, r.cfg.train.seq_len // r.layout.cp, r.layout.cp)
        if key not in self.ends_at_most:
            low = _smaller([self.per_cp(r, end_bytes, self.ends, t_end, by_ep=True, ep=e)
                            for e in sorted(set(self.ep_ends))])
            if low is None:
                return None  # budget spent: not kept (a later trace may have the time)
            self.ends_at_most[key] = low
        return self.ends_at_most[key]

    def per_cp(self, r: Row, fn: Any, memo: dict[tuple, Any], t_end: float | None,
               by_ep: bool = False, ep: int | None = None) -> dict[str, tuple[int, int]] | None:
        """``fn`` (:func:`mixer_bytes` or :func:`end_bytes`) for one row of ``r``'s micro-batch at its cp
        (under sublayer recomputation; None where the estimator traces whole chunks, or once the plan's time is
        spent); ``by_ep``: also per ep (``ep``, default ``r``'s: the head's MTP layer runs the local experts)."""
        B, T = 1, r.cfg.train.seq_len // r.layout.cp  # one row (module docstring)
        if whole_traces(r.cfg, r.layout.mbs, T):
            return None
        ep = ep or r.layout.ep
        key = (B, T, r.layout.cp) + ((ep,) if by_ep else ())
        if key not in memo:
            memo[key] = self.traced(r, fn, B, T, t_end, ep)
        return memo[key]

    def traced(self, r: Row, fn: Any, B: int, T: int, t_end: float | None, ep: int) -> Any:
        """``fn(cfg, full model, fake mode, piece cache, B, T, deadline)`` on the :class:`EstimateCache`'s fake full
        model of ``ep`` (a piece with routed experts depends on their local count, ``memory.pieces.trace_piece``),
        None when the deadline passes."""
        c = self.cache
        try:
            return fn(r.cfg, c.full_model(r.cfg, ep, c.fake), c.fake, c.pieces, B, T, t_end)
        except TraceDeadline:
            return None

    def ffn_line(self) -> str | None:
        """The FFN bytes traced for the bound, for the log (None: none traced)."""
        if not self.ffn:
            return None
        return "FFN bytes kept per micro-batch row (traced once for every cp; GiB, dense / MoE): " + "; ".join(
            f"{b} x {t} tokens{', recompute' if rc else ''}: "
            + ("budget spent" if v is None else " / ".join(f"{v[k] / 2**30:.2f}" for k in sorted(v)))
            for (b, t, rc), v in sorted(self.ffn.items()))

    def mixer_line(self) -> str | None:
        """The token-mixer bytes traced for the bound, for the log (None: none traced)."""
        if not self.mixer:
            return None
        return ("token-mixer bytes per micro-batch row (saved / backward peak, GiB; at the CP rank with the "
                "most MLA keys): " + "; ".join(
                    f"{b} x {t} tokens, cp {cp}: "
                    + ("budget spent" if v is None else ", ".join(
                        f"{k} {v[k][0] / 2**30:.2f} / {v[k][1] / 2**30:.2f}" for k in sorted(v)))
                    for (b, t, cp), v in sorted(self.mixer.items())))


def _smaller(vals: list[dict[Any, Any] | None]) -> dict[Any, Any] | None:
    """Per key, the smallest of ``vals``' values (byte counts, or tuples of them elementwise); None if any is None
    (a trace stopped by its deadline)."""
    if any(v is None for v in vals):
        return None
    return {k: (min(v[k] for v in vals) if isinstance(vals[0][k], int)
                else tuple(min(x) for x in zip(*(v[k] for v in vals)))) for k in vals[0]}
