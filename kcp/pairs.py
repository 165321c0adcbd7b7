"""Local pieces of KCP on one rank: the varlen layout of the segment and the trailing document's pair (M, S~).

A rank's segment of a row holds the tail of the document open at the segment start (it may be the whole
segment), whole documents, and the head of a trailing document. Only the trailing document part can continue
on the next rank, so the pair a rank publishes is computed over that part alone:
``M = kda_transition(trailing part)`` [H,K,K] and ``S~ = chunk_kda(trailing part, zero state).final_state``
[H,K,V] -- both chunked (no token loop), in the kernels' compute dtype (fp32 for bf16/fp32 inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

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
    """

    B: int
    T: int
    cu_seqlens: Tensor
    row_first: Tensor
    row_last: Tensor
    trail_start: Tensor
    trail_index: Tensor
    trail_cu: Tensor

    @classmethod
    def from_doc_ids(cls, doc_ids: Tensor) -> "LocalLayout":
        """``doc_ids [B, T]`` (long) -> layout on the same device."""
        if doc_ids.dim() != 2 or doc_ids.shape[1] < 1:
            raise ValueError(f"doc_ids must be [B, T>=1], got {tuple(doc_ids.shape)}")
        B, T = doc_ids.shape
        dev = doc_ids.device
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        flat_starts = torch.nonzero(starts.reshape(-1), as_tuple=False).squeeze(1)
        cu = torch.cat([flat_starts, torch.tensor([B * T], device=dev)]).to(torch.int32)
        n_per_row = starts.sum(1)
        row_last = torch.cumsum(n_per_row, 0) - 1
        row_first = row_last - n_per_row + 1
        # last start in each row: the largest index t with starts[b, t]
        idx = torch.arange(T, device=dev).expand(B, T)
        trail_start = torch.where(starts, idx, torch.zeros_like(idx)).amax(1)
        lens = T - trail_start
        trail_cu = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cumsum(lens, 0)]).to(torch.int32)
        trail_index = torch.cat([b * T + torch.arange(int(trail_start[b]), T, device=dev) for b in range(B)])
        return cls(B=B, T=T, cu_seqlens=cu, row_first=row_first, row_last=row_last, trail_start=trail_start,
                   trail_index=trail_index, trail_cu=trail_cu)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1


def flatten_tokens(x: Tensor) -> Tensor:
    """``[B, T, ...] -> [1, B*T, ...]`` (the varlen layout)."""
    return x.reshape((1, x.shape[0] * x.shape[1]) + tuple(x.shape[2:]))


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


def pairs_reference(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, layout: LocalLayout) -> tuple[Tensor, Tensor]:
    """Readable token-loop reference of :func:`trailing_pairs` (explicit M_t products and delta-rule steps)."""
    B, T, H, K = k.shape
    cd = torch.float64 if k.dtype == torch.float64 else torch.float32
    eye = torch.eye(K, dtype=cd, device=k.device).expand(H, K, K)
    Ms, Ss = [], []
    for b in range(B):
        M = eye
        S = torch.zeros(H, K, v.shape[-1], dtype=cd, device=k.device)
        for t in range(int(layout.trail_start[b]), T):
            kt, bt, at = k[b, t].to(cd), beta[b, t].to(cd), g[b, t].to(cd).exp()
            Mt = (eye - bt[:, None, None] * kt[:, :, None] * kt[:, None, :]) * at[:, None, :]
            M = Mt @ M
            S = Mt @ S + bt[:, None, None] * kt[:, :, None] * v[b, t].to(cd)[:, None, :]
        Ms.append(M)
        Ss.append(S)
    return torch.stack(Ms), torch.stack(Ss)
