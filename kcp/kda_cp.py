"""KDA context parallelism: one all-gather of (M, S~) pairs, a document-aware prefix fold, local chunked KDA.

Forward, on each rank of the CP group (``dims.group('cp')``), every row of the micro-batch at once:
  1. ``(M, S~)`` of the row's trailing document part (:func:`kcp.pairs.trailing_pairs`, chunked, fp32);
  2. ONE all-gather of the packed pairs ``[B, H, dk, dk+dv]`` (fp32);
  3. the fold over the preceding segments of the same document -> entry state ``E [B, H, dk, dv]``;
  4. chunked KDA over the whole segment with ``cu_seqlens``: each row's first document starts from ``E``, every
     other document from zero.
Backward (derivation in :mod:`kcp.fold`): ONE all-gather of the entry-state gradients ``dL/dE [B, H, dk, dv]``
(fp32); each rank then runs the transposed fold over the later ranks' transitions (kept from the forward gather)
to get ``dL/dS~`` and ``dL/dM = dL/dS~ E'^T`` for its own pair, which autograd pushes through the chunked kernels
into q, k, v, g, beta. Per rank and layer that is ``B*H*dk*(dk+dv)*4`` bytes gathered forward and
``B*H*dk*dv*4`` backward, independent of the sequence length.

The exchange is wrapped in one ``torch.autograd.Function`` (:class:`GatherFoldEntry`) so the communication is
explicit and happens exactly once per direction. To keep collectives matched across ranks, the Function always
runs when the micro-batch has any cross-rank document (the decision uses only facts every rank shares) and always
takes ``k`` as an extra input, so its backward runs on every rank even where the local pair is not needed.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from k3train.ops.kda import chunk_kda, kda_transition
from kcp.comm import CommStats, all_gather_stacked
from kcp.fold import FoldPlan, fold_adjoint, fold_entry
from kcp.pairs import KdaFn, LocalLayout, TransitionFn, flatten_tokens, trailing_pairs


def _timed(stats: CommStats | None, kind: str) -> Any:
    return stats.timed(kind) if stats is not None else contextlib.nullcontext()


class GatherFoldEntry(torch.autograd.Function):
    """``(M_local [B,H,K,K], S_local [B,H,K,V], anchor) -> E [B,H,K,V]`` over the CP group (see module doc)."""

    @staticmethod
    def forward(ctx: Any, m_local: Tensor, s_local: Tensor, anchor: Tensor, plan: FoldPlan, group: Any,
                stats: CommStats | None) -> Tensor:
        K = m_local.shape[-1]
        with _timed(stats, "kda_fold_fwd"):
            packed = torch.cat([m_local, s_local], dim=-1)
            gathered = all_gather_stacked(packed, group, stats, "kda_fwd")  # [cp, B, H, K, K+V]
            Ms, Ss = gathered[..., :K], gathered[..., K:]
            E = fold_entry(Ms, Ss, plan)
        # E' (the state entering this rank's trailing part) is E where the trailing document is the one open at
        # the segment start, else 0; dL/dM_local = A E'^T needs it.
        e_own = E * plan.own_entry_used.to(E.dtype).view(-1, 1, 1, 1)
        ctx.save_for_backward(Ms[plan.rank + 1:].clone(), e_own)  # only later ranks' M are read backwards
        ctx.plan, ctx.group, ctx.stats = plan, group, stats
        return E

    @staticmethod
    def backward(ctx: Any, grad_e: Tensor) -> tuple[Tensor | None, ...]:
        ms_later, e_own = ctx.saved_tensors
        with _timed(ctx.stats, "kda_fold_bwd"):
            grads = all_gather_stacked(grad_e.to(e_own.dtype), ctx.group, ctx.stats, "kda_bwd")  # [cp,B,H,K,V]
            A = fold_adjoint(ms_later, grads, ctx.plan)
            d_m = A @ e_own.transpose(-1, -2) if ctx.needs_input_grad[0] else None
        d_s = A if ctx.needs_input_grad[1] else None
        return d_m, d_s, None, None, None, None


def kcp_chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, layout: LocalLayout,
                  plan: FoldPlan, group: Any, scale: float | None = None, output_final_state: bool = False,
                  kda_fn: KdaFn | None = None, transition_fn: TransitionFn | None = None,
                  stats: CommStats | None = None) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA of this rank's segment with the state carried in from earlier CP ranks.

    Args:
        q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` -- this rank's contiguous segment of
            every row (T = local length, equal on all ranks of ``group``).
        layout: the segment's varlen layout; plan: this rank's fold plan (both from :class:`kcp.KCPContext`).
        group: the CP process group (``dims.group('cp')``), or None for a single rank.
        output_final_state: also return each row's state after its last local token (trailing document).
        kda_fn / transition_fn: ``chunk_kda`` / ``kda_transition`` (default: :mod:`k3train.ops.kda`).
    Returns:
        ``(o [B, T, H, V], final [B, H, K, V] or None)``. Collective: forward and backward each one all-gather
        over ``group`` when some document crosses a segment boundary, none otherwise.
    """
    kda_fn = kda_fn or chunk_kda
    transition_fn = transition_fn or kda_transition
    B, T, H, K = k.shape
    if (B, T) != (layout.B, layout.T):
        raise ValueError(f"KCP: q/k/v are [B, T] = {(B, T)} but the context was built for {(layout.B, layout.T)}")
    init = None
    if plan.any_chain:
        Vd = v.shape[-1]
        cdt = torch.float64 if k.dtype == torch.float64 else torch.float32
        if bool(plan.needs_pairs.any()):
            with _timed(stats, "kda_pairs_fwd"):
                m_loc, s_loc = trailing_pairs(k, v, g, beta, layout, kda_fn=kda_fn, transition_fn=transition_fn)
            m_loc, s_loc = m_loc.to(cdt), s_loc.to(cdt)
        else:  # nobody folds this rank's pairs (e.g. the last rank): skip the local pass, send zeros
            m_loc = k.new_zeros(B, H, K, K, dtype=cdt)
            s_loc = k.new_zeros(B, H, K, Vd, dtype=cdt)
        entry = GatherFoldEntry.apply(m_loc, s_loc, k, plan, group, stats)
        rows_first = layout.row_first.to(k.device)
        init = entry.new_zeros(layout.num_seqs, H, K, Vd).index_copy(0, rows_first, entry)
    o, final = kda_fn(*(flatten_tokens(x) for x in (q, k, v, g, beta)), scale=scale, initial_state=init,
                      output_final_state=output_final_state, cu_seqlens=layout.cu_seqlens.to(k.device))
    o = o.reshape(B, T, H, o.shape[-1])
    if output_final_state:
        final = final[layout.row_last.to(k.device)]
    return o, final
