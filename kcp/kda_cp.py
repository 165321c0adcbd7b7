"""KDA context parallelism: one all-gather of (M, S~) pairs, a document-aware prefix fold, local chunked KDA.

Forward, on each rank of the CP group (``dims.group('cp')``), every row of the micro-batch at once:
  1. ONE local chunked pass (:func:`kcp.pairs.augmented_pass`) over the whole segment with ``cu_seqlens``: outputs
     from zero states, the ``(M, S~)`` pair of each row's trailing document part, and the transport vectors of
     each row's first document (fp32);
  2. ONE all-gather of the packed pairs ``[B, H, dk, dk+dv]`` (fp32);
  3. the fold over the preceding segments of the same document -> entry state ``E [B, H, dk, dv]``;
  4. ``o_t += E^T c_t`` on each row's first document (the entry state's contribution, by linearity) -- identical
     to running the chunked KDA with ``E`` as that document's initial state, without a second pass.
Backward (derivation in :mod:`kcp.fold`): ONE all-gather of the entry-state gradients ``dL/dE [B, H, dk, dv]``
(fp32); each rank then runs the transposed fold over the later ranks' transitions (kept from the forward gather)
to get ``dL/dS~`` and ``dL/dM = dL/dS~ E'^T`` for its own pair, which autograd pushes through the chunked kernels
into q, k, v, g, beta. Per rank and layer that is ``B*H*dk*(dk+dv)*4`` bytes gathered forward and
``B*H*dk*dv*4`` backward, independent of the sequence length.

The exchange is wrapped in one ``torch.autograd.Function`` (:class:`GatherFoldEntry`) so the communication is
explicit and happens exactly once per direction. Hang safety, by construction rather than by case:
  * whether to communicate at all is decided by ``plan.any_chain``, computed from the gathered layout of every
    rank (identical everywhere); local facts (does this rank have an entry state, is its pair read) only choose
    between local computations;
  * the Function takes the layer inputs as extra (gradient-free) inputs, so its output requires grad on every
    rank even where the local pair is not computed (it sends zeros), and the producers of q, k, v, g, beta wait
    for its backward (a fixed order against the layer's other exchanges);
  * the entry state is :func:`kcp.comm.tie`-d into the returned output on every rank, so the backward all-gather
    runs whenever the output is used -- also on a rank whose output does not depend on the entry state
    numerically (its segment starts at a document start and its pair feeds nobody).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from k3train.ops.kda import chunk_kda
from kcp.comm import CommStats, all_gather_stacked, tie
from kcp.fold import FoldPlan, fold_adjoint, fold_entry
from kcp.pairs import KdaFn, LocalLayout, augmented_pass, flatten_tokens


def _timed(stats: CommStats | None, kind: str) -> Any:
    return stats.timed(kind) if stats is not None else contextlib.nullcontext()


class GatherFoldEntry(torch.autograd.Function):
    """``(M_local [B,H,K,K], S_local [B,H,K,V]) -> E [B,H,K,V]`` over the CP group (see module doc).

    ``anchors`` (the layer's q, k, v, g, beta) only tie the node into the graph: gradients never flow to them
    from here, but their presence makes the backward (a collective) run on every rank.
    """

    @staticmethod
    def forward(ctx: Any, m_local: Tensor, s_local: Tensor, plan: FoldPlan, group: Any, stats: CommStats | None,
                *anchors: Tensor) -> Tensor:
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
        return (d_m, d_s, None, None, None) + (None,) * (len(ctx.needs_input_grad) - 5)


def kcp_chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, layout: LocalLayout,
                  plan: FoldPlan, group: Any, scale: float | None = None, output_final_state: bool = False,
                  kda_fn: KdaFn | None = None, stats: CommStats | None = None) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA of this rank's segment with the state carried in from earlier CP ranks.

    Args:
        q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` -- this rank's contiguous segment of
            every row (T = local length, equal on all ranks of ``group``).
        layout: the segment's varlen layout; plan: this rank's fold plan (both from :class:`kcp.KCPContext`).
        group: the CP process group (``dims.group('cp')``), or None for a single rank.
        output_final_state: also return each row's state after its last local token (trailing document).
        kda_fn: the chunked kernel (default :func:`k3train.ops.kda.chunk_kda`; any function with its signature).
    Returns:
        ``(o [B, T, H, V] in q's dtype, final [B, H, K, V] fp32 or None)``. Collective: forward and backward each
        one all-gather over ``group`` when some document crosses a segment boundary, none otherwise.
    """
    kda_fn = kda_fn or chunk_kda
    B, T, H, K = k.shape
    if (B, T) != (layout.B, layout.T):
        raise ValueError(f"KCP: q/k/v are [B, T] = {(B, T)} but the context was built for {(layout.B, layout.T)}")
    flat_cu = layout.cu_seqlens.to(k.device)
    if not plan.any_chain:  # every segment boundary is a document boundary: plain local KDA, no communication
        o, final = kda_fn(*(flatten_tokens(x) for x in (q, k, v, g, beta)), scale=scale,
                          output_final_state=output_final_state, cu_seqlens=flat_cu)
        return o.reshape(B, T, H, -1), (final[layout.row_last.to(k.device)] if output_final_state else None)

    Vd = v.shape[-1]
    has_entry = bool((plan.fwd_b[: plan.rank] != 0).any())
    with _timed(stats, "kda_local_fwd"):
        if has_entry or bool(plan.needs_pairs.any()) or output_final_state:
            o0, transport, m_loc, s_loc = augmented_pass(q, k, v, g, beta, layout, scale=scale, kda_fn=kda_fn)
        else:  # neither an entry state nor a pair to publish: plain pass, zero pair (never read)
            o0, _ = kda_fn(*(flatten_tokens(x) for x in (q, k, v, g, beta)), scale=scale, cu_seqlens=flat_cu)
            o0 = o0.reshape(B, T, H, Vd)
            cd = torch.float64 if k.dtype == torch.float64 else torch.float32
            transport = None
            m_loc, s_loc = k.new_zeros(B, H, K, K, dtype=cd), k.new_zeros(B, H, K, Vd, dtype=cd)
    entry = GatherFoldEntry.apply(m_loc, s_loc, plan, group, stats, q, k, v, g, beta)
    o = o0 if transport is None else o0 + torch.einsum("bthk,bhkv->bthv", transport, entry)
    final = None
    if output_final_state:  # trailing document: M E' + S~ (E' = E only where it is also the first document)
        final = m_loc @ (entry * plan.own_entry_used.to(entry.dtype).view(-1, 1, 1, 1)) + s_loc
    return tie(o.to(q.dtype), entry), final
