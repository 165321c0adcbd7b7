"""Local pieces of KCP on one rank: the segment's varlen layout, and ONE chunked pass that yields everything.

A rank's segment of a row holds the tail of the document open at the segment start (it may be the whole
segment), whole documents, and the head of a trailing document. Only the trailing document part can continue
on the next rank, so the pair a rank publishes is computed over that part alone: ``M`` [H,K,K] (the product of
its ``M_t``) and ``S~`` [H,K,V] (its state from zero).

:func:`augmented_pass` gets the pair, the zero-start outputs and what the first document needs to add its entry
state later, from a single ``chunk_kda`` call, by linearity of KDA in (initial state, values): run it with values
``[v | 0_K]`` (width V+K) and initial state ``[0 | I_K]`` for each row's first and trailing document. The state
then carries ``[S_t | M_<=t]``, so
  * the trailing document's final state is ``[S~ | M]``;
  * the first document's outputs are ``[o0_t | c_t]`` with ``c_t = scale * M_<=t^T q_t`` ("transport" vectors),
    and its true output once the entry state ``E`` is known is ``o_t = o0_t + E^T c_t`` -- a cheap K x V product
    per token instead of a second chunked pass.
(Compute: one pass at width V+K, about 1.6x a plain pass at K = V, instead of a pair pass + a transition + the
main pass, about 2.5x.) :func:`trailing_pairs` is the direct two-kernel computation of the pair (``kda_transition``
and ``chunk_kda``'s zero-start final state); the tests check the two against each other and the token loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from k3train.model.seq import cu_seqlens_from_doc_ids

KdaFn = Callable[..., tuple[Tensor, Tensor | None]]
TransitionFn = Callable[..., Tensor]


@dataclass(frozen=True)
class LocalLayout:
    """Varlen layout of this rank's ``[B, T]`` segment (flattened to ``[1, B*T]`` for the kernels).

    cu_seqlens: int32 ``[N+1]`` -- a boundary at every row start and document start.
    row_first: long ``[B]`` index (in 0..N-1) of each row's first sequence (the one that gets the entry state).
    row_last: long ``[B]`` index of each row's trailing sequence.
    trail_start: long ``[B]`` local index where each row's trailing document part begins.
    trail_index: long ``[sum(T - trail_start)]`` flat token indices of the trailing parts, row after row.
    trail_cu: int32 ``[B+1]`` offsets of the trailing parts inside ``trail_index``.
    first_doc_mask: bool ``[B, T]`` tokens of each row's first document (the one the entry state flows into).
    """

    B: int
    T: int
    cu_seqlens: Tensor
    row_first: Tensor
    row_last: Tensor
    trail_start: Tensor
    trail_index: Tensor
    trail_cu: Tensor
    first_doc_mask: Tensor

    @classmethod
    def from_doc_ids(cls, doc_ids: Tensor) -> "LocalLayout":
        """``doc_ids [B, T]`` (long) -> layout on the same device."""
        if doc_ids.dim() != 2 or doc_ids.shape[1] < 1:
            raise ValueError(f"doc_ids must be [B, T>=1], got {tuple(doc_ids.shape)}")
        B, T = doc_ids.shape
        dev = doc_ids.device
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        cu = cu_seqlens_from_doc_ids(doc_ids)  # the same boundaries the model's SeqInfo uses
        n_per_row = starts.sum(1)
        row_last = torch.cumsum(n_per_row, 0) - 1
        row_first = row_last - n_per_row + 1
        # last start in each row: the largest index t with starts[b, t]
        idx = torch.arange(T, device=dev).expand(B, T)
        trail_start = torch.where(starts, idx, torch.zeros_like(idx)).amax(1)
        lens = T - trail_start
        trail_cu = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cumsum(lens, 0)]).to(torch.int32)
        trail_index = torch.cat([b * T + torch.arange(int(trail_start[b]), T, device=dev) for b in range(B)])
        first_doc_mask = torch.cumsum(starts.long(), 1) == 1
        return cls(B=B, T=T, cu_seqlens=cu, row_first=row_first, row_last=row_last, trail_start=trail_start,
                   trail_index=trail_index, trail_cu=trail_cu, first_doc_mask=first_doc_mask)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1


def flatten_tokens(x: Tensor) -> Tensor:
    """``[B, T, ...] -> [1, B*T, ...]`` (the varlen layout)."""
    return x.reshape((1, x.shape[0] * x.shape[1]) + tuple(x.shape[2:]))


def augmented_pass(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, layout: LocalLayout, *,
                   scale: float | None, kda_fn: KdaFn) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The single local pass of KCP (see the module docstring).

    Args: q, k, g ``[B,T,H,K]``, v ``[B,T,H,V]``, beta ``[B,T,H]``: this rank's segment (differentiable).
    Returns, in the compute dtype (fp32, or float64 for float64 inputs):
        ``o0 [B,T,H,V]`` outputs from zero states, ``transport [B,T,H,K]`` (``scale * M_<=t^T q_t`` on each row's
        first document, 0 elsewhere), ``M [B,H,K,K]`` and ``S~ [B,H,K,V]`` of each row's trailing part.
    No communication.
    """
    B, T, H, K = k.shape
    Vd = v.shape[-1]
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(cd) for x in (q, k, v, g, beta))  # fp32 outputs: the correction adds to them
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    eye_rows = torch.zeros(layout.num_seqs, dtype=cd, device=k.device)
    eye_rows[layout.row_first.to(k.device)] = 1.0
    eye_rows[layout.row_last.to(k.device)] = 1.0
    init = torch.zeros(layout.num_seqs, H, K, Vd + K, dtype=cd, device=k.device)
    init[..., Vd:] = eye_rows.view(-1, 1, 1, 1) * torch.eye(K, dtype=cd, device=k.device)
    o_aug, final = kda_fn(*(flatten_tokens(x) for x in (q, k, v_aug, g, beta)), scale=scale, initial_state=init,
                          output_final_state=True, cu_seqlens=layout.cu_seqlens.to(k.device))
    o_aug = o_aug.reshape(B, T, H, Vd + K)
    first = layout.first_doc_mask.to(k.device).view(B, T, 1, 1).to(cd)
    last = final[layout.row_last.to(k.device)]
    return o_aug[..., :Vd], o_aug[..., Vd:] * first, last[..., Vd:], last[..., :Vd]


def trailing_pairs(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, layout: LocalLayout, *,
                   kda_fn: KdaFn, transition_fn: TransitionFn) -> tuple[Tensor, Tensor]:
    """Pair of every row's trailing document part.

    Args: k, g ``[B,T,H,K]``, v ``[B,T,H,V]``, beta ``[B,T,H]`` (this rank's segment; differentiable).
    Returns ``(M [B,H,K,K], S~ [B,H,K,V])`` in the kernels' compute dtype. No communication.
    """
    idx = layout.trail_index.to(k.device)
    cu = layout.trail_cu.to(k.device)
    kt, vt, gt, bt = (flatten_tokens(x)[:, idx] for x in (k, v, g, beta))
    M = transition_fn(kt, gt, bt, cu_seqlens=cu)
    # chunk_kda always produces an output; the query only affects that discarded output, so k stands in for q.
    _, S = kda_fn(kt, kt, vt, gt, bt, initial_state=None, output_final_state=True, cu_seqlens=cu)
    return M, S
