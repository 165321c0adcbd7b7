"""The KCP prefix fold over preceding segments of the same document, its adjoint, and their plan.

Notation (per row b, per head; rank r holds the contiguous segment r of every row). Each rank publishes the pair
``(M_r, S~_r)`` of its *trailing document part* -- the tokens from the last document start inside the segment
(or from the segment start when no document starts inside it) to the segment end:
``M_r = M_T ... M_1`` with ``M_t = (I - b_t k_t k_t^T) Diag(exp(g_t))`` and ``S~_r`` = the state after those tokens
from a zero state. The state at the end of segment r for its trailing document is then the exit state
``X_r = M_r E'_r + S~_r``, where ``E'_r`` = the entry state ``E_r`` if the trailing document is the one open at
the segment start, else 0. The entry state of rank r is ``E_r = X_{r-1}`` if the document open at r's first
token is r-1's trailing document (same id across the boundary), else 0.

Unrolled: ``E_r = sum_{j in chain(r)} (prod_{l in chain(r), l > j} M_l) S~_j`` where ``chain(r)`` is the run of
ranks ``j0 < ... < r-1`` whose trailing document is r's first document, stopping (inclusively) at the rank j0 where
that document starts (its M is not applied: nothing of the document precedes it). This is the associative
composition ``(M2, S2) o (M1, S1) = (M2 M1, S2 + M2 S1)`` restricted to one document.

Backward. E_r is linear in the pairs; with ``G_i = dL/dE_i`` (from the local chunked KDA that consumed E_i as its
initial state), the adjoint of rank r's exit state is ``A_r = dL/dX_r = sum_{i in later(r)} P_{i,r}^T G_i``,
``later(r) = {i > r : r in chain(i)} = r+1..i_max`` (contiguous) and ``P_{i,r} = M_{i-1} ... M_{r+1}``. It obeys
the reverse recursion ``A = G_{i_max}``, then ``A <- G_i + M_i^T A`` for ``i = i_max-1 .. r+1``: the same fold run
backwards with transposed transitions. Then ``dL/dS~_r = A_r`` and ``dL/dM_r = A_r E'_r^T`` (E'_r is known to
rank r itself). So the backward needs every rank's ``G_i`` [B,H,dk,dv] (one all-gather) and the later ranks'
``M_i`` (kept from the forward all-gather): no pair gradients are ever sent.

Both folds are vectorised over rows with 0/1 coefficients so that every rank runs the same tensor program:
forward ``E <- a_j (M_j E) + b_j S~_j`` for ``j = 0..r-1``; backward ``A <- c_i (M_i^T A) + d_i G_i`` for
``i = cp-1..r+1``. The readable per-row references (:func:`chain_ranks`, :func:`fold_entry_reference`) are what the
tests compare against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SegmentDocs:
    """Document facts of every CP rank's segment, per row (all ``[cp, B]``, identical on every rank).

    ``first``/``last``: doc id of the segment's first/last token; ``inner_start``: a document starts at some
    local index > 0 (so the trailing part is shorter than the segment).
    """

    first: Tensor
    last: Tensor
    inner_start: Tensor

    @classmethod
    def from_doc_ids(cls, doc_ids_all: Tensor) -> "SegmentDocs":
        """``doc_ids_all [cp, B, T]`` (every rank's local doc ids, rank order)."""
        if doc_ids_all.dim() != 3 or doc_ids_all.shape[-1] < 1:
            raise ValueError(f"doc_ids_all must be [cp, B, T>=1], got {tuple(doc_ids_all.shape)}")
        inner = (doc_ids_all[..., 1:] != doc_ids_all[..., :-1]).any(-1)
        return cls(first=doc_ids_all[..., 0], last=doc_ids_all[..., -1], inner_start=inner)

    @property
    def cp(self) -> int:
        return self.first.shape[0]

    @property
    def rows(self) -> int:
        return self.first.shape[1]


def chain_ranks(docs: SegmentDocs, rank: int, row: int) -> list[int]:
    """Readable reference: the preceding ranks (ascending) whose pairs fold into ``rank``'s entry state for ``row``."""
    doc = int(docs.first[rank, row])
    out: list[int] = []
    j = rank - 1
    while j >= 0 and int(docs.last[j, row]) == doc:  # j's trailing document is our first document
        out.append(j)
        if bool(docs.inner_start[j, row]):  # the document starts inside segment j: nothing earlier belongs to it
            break
        j -= 1
    return out[::-1]


@dataclass(frozen=True)
class FoldPlan:
    """0/1 coefficients of the vectorised fold for one rank (see the module docstring).

    fwd_a, fwd_b: ``[cp, B]`` forward ``E <- a_j (M_j E) + b_j S~_j`` (only j < rank used).
    bwd_c, bwd_d: ``[cp, B]`` backward ``A <- c_i (M_i^T A) + d_i G_i`` (only i > rank used).
    own_entry_used: ``[B]`` 1 where this rank's trailing document is the one open at its segment start (E' = E).
    needs_pairs: ``[B]`` True where the next rank folds this rank's pair (otherwise the pair is never read).
    any_chain: some row of some rank has a non-empty chain (identical on all ranks: else no communication).
    """

    rank: int
    cp: int
    fwd_a: Tensor
    fwd_b: Tensor
    bwd_c: Tensor
    bwd_d: Tensor
    own_entry_used: Tensor
    needs_pairs: Tensor
    any_chain: bool


def _all_chains(docs: SegmentDocs) -> list[list[list[int]]]:
    """``[rank][row]``: :func:`chain_ranks` of every rank and row, on Python lists (one ``tolist`` per field
    instead of a tensor read per step: the walk is O(cp^2) per row, and every CP rank plans every rank's chain)."""
    first, last, inner = docs.first.tolist(), docs.last.tolist(), docs.inner_start.tolist()
    out = []
    for rank in range(docs.cp):
        per_row = []
        for row in range(docs.rows):
            doc, chain, j = first[rank][row], [], rank - 1
            while j >= 0 and last[j][row] == doc:
                chain.append(j)
                if inner[j][row]:
                    break
                j -= 1
            per_row.append(chain[::-1])
        out.append(per_row)
    return out


def plan_fold(docs: SegmentDocs, rank: int) -> FoldPlan:
    """Build ``rank``'s fold coefficients from every rank's segment document facts."""
    cp, B = docs.cp, docs.rows
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} outside CP size {cp}")
    chains = _all_chains(docs)
    fwd_a = torch.zeros(cp, B)
    fwd_b = torch.zeros(cp, B)
    for b, chain in enumerate(chains[rank]):
        for pos, j in enumerate(chain):
            fwd_b[j, b] = 1.0
            fwd_a[j, b] = 0.0 if pos == 0 else 1.0  # the chain start's M multiplies a zero state: skip it
    bwd_c = torch.zeros(cp, B)
    bwd_d = torch.zeros(cp, B)
    for b in range(B):
        later = [i for i in range(rank + 1, cp) if rank in chains[i][b]]  # contiguous rank+1..i_max
        for i in later:
            bwd_d[i, b] = 1.0
            bwd_c[i, b] = 0.0 if i == later[-1] else 1.0
    own = (~docs.inner_start[rank]).to(torch.float32)
    needs = torch.zeros(B, dtype=torch.bool)
    if rank + 1 < cp:
        needs = torch.tensor([rank in chains[rank + 1][b] for b in range(B)], dtype=torch.bool)
    any_chain = any(len(c) > 0 for per_rank in chains for c in per_rank)
    return FoldPlan(rank=rank, cp=cp, fwd_a=fwd_a, fwd_b=fwd_b, bwd_c=bwd_c, bwd_d=bwd_d,
                    own_entry_used=own, needs_pairs=needs, any_chain=any_chain)


def _coef(c: Tensor, like: Tensor) -> Tensor:
    """``[B]`` coefficients broadcast over ``[B, H, K, *]``."""
    return c.to(device=like.device, dtype=like.dtype).view(-1, 1, 1, 1)


def fold_entry(Ms: Tensor, Ss: Tensor, plan: FoldPlan) -> Tensor:
    """Entry states ``E [B,H,K,V]`` of ``plan.rank`` from all ranks' pairs ``Ms [cp,B,H,K,K]``, ``Ss [cp,B,H,K,V]``."""
    E = torch.zeros_like(Ss[0])
    for j in range(plan.rank):
        a, b = plan.fwd_a[j], plan.fwd_b[j]
        if not bool((a != 0).any() or (b != 0).any()):
            continue
        E = _coef(a, E) * (Ms[j] @ E) + _coef(b, E) * Ss[j]
    return E


def fold_adjoint(Ms_later: Tensor, Gs: Tensor, plan: FoldPlan) -> Tensor:
    """Adjoint of ``plan.rank``'s exit state, ``A [B,H,K,V]``.

    ``Ms_later [cp-rank-1, B,H,K,K]``: the transitions of ranks rank+1..cp-1; ``Gs [cp,B,H,K,V]``: every rank's
    gradient wrt its entry state.
    """
    r = plan.rank
    A = torch.zeros_like(Gs[0])
    for i in range(plan.cp - 1, r, -1):
        c, d = plan.bwd_c[i], plan.bwd_d[i]
        if not bool((c != 0).any() or (d != 0).any()):
            continue
        A = _coef(c, A) * (Ms_later[i - r - 1].transpose(-1, -2) @ A) + _coef(d, A) * Gs[i]
    return A


def fold_entry_reference(Ms: Tensor, Ss: Tensor, docs: SegmentDocs, rank: int) -> Tensor:
    """Readable per-row loop of the forward fold (test reference for :func:`fold_entry`)."""
    E = torch.zeros_like(Ss[0])
    for b in range(docs.rows):
        s = torch.zeros_like(Ss[0, b])
        for j in chain_ranks(docs, rank, b):
            s = Ms[j, b] @ s + Ss[j, b]
        E[b] = s
    return E
