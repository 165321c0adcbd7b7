"""Chunkwise-parallel KDA (Kimi Delta Attention) in plain differentiable torch ops: the autograd reference.

The training path is :mod:`k3train.ops.kda_function` (same math, hand-written backward); this module stays as the
reference its tests compare against, and provides ``kda_transition`` for KCP.

Recurrence per head (see :mod:`k3train.ops.kda_naive` for the token loop it must match)::

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,      o_t = scale * S_t^T q_t

Chunk form. Inside one chunk of C tokens entered with state S_0, let G_i = g_1 + ... + g_i (inclusive cumulative
log decay, per key channel) and Gamma_i = exp(G_i). Writing the update as S_i = Diag(exp g_i) S_{i-1} + k_i u_i^T
gives ``S_i = Diag(Gamma_i) S_0 + sum_{j<=i} Diag(Gamma_i / Gamma_j) k_j u_j^T`` and the "new values"
``u_i = b_i (v_i - k_i^T Diag(exp g_i) S_{i-1})`` satisfy the unit-lower-triangular system

    (I + A) U = Diag(b) V - Diag(b) (Gamma * K) S_0,     A_ij = b_i k_i^T Diag(Gamma_i / Gamma_j) k_j  (j < i)

so (UT / WY transform) ``U = Uw - W S_0`` with ``[W | Uw] = (I + A)^{-1} [Diag(b)(Gamma*K) | Diag(b) V]`` -- one
batched triangular solve per chunk; ``U - W S`` are the pseudo-values. Then, with P_ij = q_i^T Diag(Gamma_i /
Gamma_j) k_j (j <= i):

    O     = (Gamma * Q) S_0 + P U = P Uw + (Gamma * Q - P W) S_0
    S_C   = M S_0 + H,    M = Diag(Gamma_C) - (K * Gamma_C / Gamma)^T W,    H = (K * Gamma_C / Gamma)^T Uw

Everything except ``S_{c+1} = M_c S_c + H_c`` is batched over all chunks, heads and documents; that fold is the only
loop (over chunk index, batched across documents), and M is exactly the per-chunk transition KCP needs.

Numerics of the pair terms exp(G_i - G_j) (j <= i, always <= 1, but exp(G_i) * exp(-G_j) can overflow):
  * across 16-token sub-tiles (rows in sub-tile s, columns before it) the factor is split at the sub-tile boundary
    r_s = G_{16 s - 1}: exp(G_i - r_s) * exp(r_s - G_j), both <= 1 for any g <= 0, so these blocks are dense
    matmuls with no overflow risk even for an unbounded (softplus) gate. Both exponents are accumulated directly
    over the tokens they span (never as a difference of two large prefix sums, which cancels in fp32);
  * inside a diagonal sub-tile we use a per-channel reference m at the middle of the sub-tile's log-decay range:
    exp(G_i - m) * exp(m - G_j), each factor within exp(+-span/2). K3's lower-bounded gate (g >= -5) keeps the span
    of 16 tokens below 75 (the spec's "(-80, 0]"), so the factors stay within e^37.5 -- far from fp32's e^88.7 --
    and the diagonal sub-tiles are dense matmuls too. For gates without that bound (span above
    ``_DENSE_SPAN_MAX``) the diagonal sub-tiles fall back to an explicit masked 16x16xK pair product, which is exact
    for any g <= 0 (masked exponents are -inf, never +large).
The midpoint m is detached: each product is mathematically independent of it.

All arithmetic is fp32 (float64 inputs stay float64); o is returned in the input dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .kda_naive import check_kda_inputs, compute_dtype

__all__ = ["chunk_kda_autograd", "kda_transition", "SUB_TILE"]

SUB_TILE = 16
# Largest per-channel log-decay span inside one 16-token sub-tile for which the diagonal sub-tiles use the dense
# factorisation (factors within exp(+-span/2)); fp32: e^40 leaves ~1e21 headroom below overflow for the matmul
# sums and their gradients. The lower-bounded gate (g >= -5) always satisfies it (span <= 15 * 5 = 75).
_DENSE_SPAN_MAX = {torch.float32: 80.0, torch.float64: 600.0}


# ----------------------------------------------------------------------------------------------------------------
# Layout: sequences / documents padded to chunk multiples, all chunks stacked
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class _Layout:
    gather: Tensor           # [NC*C] flat token index per padded slot; == n_tokens for padding (a zero row)
    scatter: Tensor          # [n_tokens] padded slot of every real token
    n_chunks: int            # NC, total chunks over all documents
    order: Tensor            # [N] documents sorted by chunk count, descending
    inv_order: Tensor        # [N] inverse of ``order``
    step_ids: list[Tensor]   # step j: chunk ids of the j-th chunk of the first n_j sorted documents
    entry_inv: Tensor        # [NC] reorders the step-major entry states into chunk-id order


def _build_layout(lengths: list[int], chunk: int, device: torch.device) -> _Layout:
    """Index tensors for documents of the given lengths (flat, consecutive). Loops only over documents/steps."""
    n_docs = len(lengths)
    lens = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(lens, 0) - lens
    n_ch = (lens + chunk - 1) // chunk
    first = torch.cumsum(n_ch, 0) - n_ch
    nc = int(n_ch.sum())
    n_tok = int(lens.sum())
    doc_of_chunk = torch.repeat_interleave(torch.arange(n_docs), n_ch)
    off = (torch.arange(nc) - first[doc_of_chunk])[:, None] * chunk + torch.arange(chunk)     # [NC, C]
    gather = torch.where(off < lens[doc_of_chunk][:, None], starts[doc_of_chunk][:, None] + off, n_tok)
    doc_of_tok = torch.repeat_interleave(torch.arange(n_docs), lens)
    scatter = first[doc_of_tok] * chunk + torch.arange(n_tok) - starts[doc_of_tok]
    order = torch.sort(n_ch, descending=True, stable=True).indices
    sorted_first, sorted_n = first[order], n_ch[order]
    step_ids = []
    for j in range(int(sorted_n.max()) if n_docs else 0):
        n_j = int((sorted_n > j).sum())            # sorted descending: the active documents are a prefix
        step_ids.append(sorted_first[:n_j] + j)
    perm = torch.cat(step_ids) if step_ids else torch.zeros(0, dtype=torch.long)
    entry_inv = torch.empty_like(perm)
    entry_inv[perm] = torch.arange(perm.numel())
    to = dict(device=device)
    return _Layout(gather.reshape(-1).to(**to), scatter.to(**to), nc, order.to(**to),
                   torch.argsort(order).to(**to), [s.to(**to) for s in step_ids], entry_inv.to(**to))


def doc_lengths(B: int, T: int, cu_seqlens: Tensor | None) -> list[int]:
    if cu_seqlens is None:
        return [T] * B
    cu = cu_seqlens.tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _to_chunks(x: Tensor, layout: _Layout, chunk: int, cd: torch.dtype) -> Tensor:
    """[B,T,H,*] -> [NC,H,C,*] in dtype ``cd``; padding slots are zeros (identity transition: g=0, k=0, b=0)."""
    flat = x.reshape(-1, *x.shape[2:]).to(cd)
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])], 0)
    return flat[layout.gather].reshape(layout.n_chunks, chunk, *flat.shape[1:]).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# Intra-chunk math (batched over chunks and heads)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class _Decay:
    """Log-decay sums of every chunk, each formed as a sum of same-sign terms.

    Differences of chunk-level prefix sums (G_i - G_j) cancel catastrophically in fp32 once |G| is large (a softplus
    gate can reach |G| ~ 1e3-1e4 inside one chunk, where the fp32 spacing is ~1e-3), so every exponent used below is
    accumulated directly over the tokens it spans instead.
    """
    gt: Tensor       # [..., n, 16, K] the per-token g, by sub-tile
    G: Tensor        # [..., C, K]     sum g over [chunk start, i]                (Gamma_i = exp(G_i))
    suf: Tensor      # [..., C, K]     sum g over (j, chunk end]                  (= G_C - G_j)
    Gl: Tensor       # [..., n, 16, K] sum g over [sub-tile start, i]
    sufl: Tensor     # [..., n, 16, K] sum g over (j, sub-tile end]
    between: Tensor  # [..., n, n, K]  [s, t]: sum of the sub-tiles strictly between t and s (t < s), else 0
    span: float      # largest per-channel range of Gl within a sub-tile (decides the dense diagonal path)


def _decay_sums(g: Tensor) -> _Decay:
    """g: [..., C, K] per-token log decay of each chunk (C a multiple of 16) -> :class:`_Decay`."""
    n = g.shape[-2] // SUB_TILE
    gt = g.unflatten(-2, (n, SUB_TILE))
    Gl = gt.cumsum(-2)
    tot = Gl[..., -1, :]                                                          # [..., n, K] sub-tile totals
    offset = F.pad(tot.cumsum(-2)[..., :-1, :], (0, 0, 1, 0))                     # sum of earlier sub-tiles
    G = (Gl + offset[..., None, :]).flatten(-3, -2)
    rev = lambda x: x.flip(-2).cumsum(-2).flip(-2)                                # noqa: E731, inclusive suffix
    suf = F.pad(rev(g)[..., 1:, :], (0, 0, 0, 1))
    sufl = F.pad(rev(gt)[..., 1:, :], (0, 0, 0, 1))
    u = torch.arange(n, device=g.device)
    strictly_between = ((u[None, None, :] < u[:, None, None]) & (u[None, :, None] < u[None, None, :])).to(g.dtype)
    between = torch.einsum("stu,...uk->...stk", strictly_between, tot)
    span = float((Gl.amax(-2) - Gl.amin(-2)).max().detach()) if g.numel() else 0.0
    return _Decay(gt, G, suf, Gl, sufl, between, span)


def _decayed_gram(x: Tensor, k: Tensor, dec: _Decay, *, strict: bool, dense_diag: bool) -> Tensor:
    """``L_ij = sum_c x_ic k_jc exp(G_ic - G_jc)`` for j < i (``strict``) or j <= i, else 0.

    x, k: ``[..., C, K]`` with C a multiple of 16 -> ``[..., C, C]``. See the module docstring for the numerics.
    """
    *lead, C, K = x.shape
    n = C // SUB_TILE
    xt, kt, Gl = x.unflatten(-2, (n, SUB_TILE)), k.unflatten(-2, (n, SUB_TILE)), dec.Gl     # [..., n, 16, K]
    idx = torch.arange(SUB_TILE, device=x.device)
    keep = idx[None, :] < idx[:, None] if strict else idx[None, :] <= idx[:, None]   # [i, j]
    # Diagonal sub-tiles.
    if dense_diag:
        m = (0.5 * (Gl.amax(-2, keepdim=True) + Gl.amin(-2, keepdim=True))).detach()
        d = (xt * (Gl - m).exp()) @ (kt * (m - Gl).exp()).transpose(-1, -2)      # [..., n, 16, 16]
        d = d * keep.to(d.dtype)                                                 # upper part is finite, dropped
    else:
        # exponent_ij = sum of g_t over j < t <= i as a masked sum (no cancellation), -inf above the diagonal
        span_ij = ((idx[None, None, :] > idx[None, :, None]) & (idx[None, None, :] <= idx[:, None, None]))
        expo = (span_ij.flatten(0, 1).to(x.dtype) @ dec.gt).unflatten(-2, (SUB_TILE, SUB_TILE))
        expo = expo.masked_fill(~keep[:, :, None], float("-inf"))                # [..., n, 16, 16, K]
        d = (xt[..., :, None, :] * kt[..., None, :, :] * expo.exp()).sum(-1)     # explicit, exact for any g <= 0
    eye_n = torch.eye(n, dtype=d.dtype, device=d.device)[:, None, :, None]       # block-diagonal placement
    out = (d[..., :, :, None, :] * eye_n).reshape(*lead, C, C)
    if n == 1:
        return out
    # Blocks below the diagonal: rows of sub-tile s >= 1 against the tokens j of every earlier sub-tile t < s,
    # split at the boundary before s: exp(sum over [start of s, i]) * exp(sum over (j, end of s-1]), both <= 1.
    ce = C - SUB_TILE
    # The column factor is itself a product of two factors <= 1: exp(sum over (j, end of t]) from inside sub-tile t
    # and exp(sum over the sub-tiles strictly between t and s); the pair mask t < s zeroes the rest.
    xs = xt[..., 1:, :, :] * Gl[..., 1:, :, :].exp()                             # [..., n-1, 16, K]
    ks = kt[..., :-1, :, :] * dec.sufl[..., :-1, :, :].exp()                     # [..., t=n-1, 16, K]
    before = torch.arange(n - 1, device=x.device)[None, :] < torch.arange(1, n, device=x.device)[:, None]
    hop = dec.between[..., 1:, :-1, :].exp() * before[:, :, None].to(x.dtype)    # [..., s=n-1, t=n-1, K]
    ks = (ks[..., None, :, :, :] * hop[..., None, :]).flatten(-3, -2)            # [..., s, ce, K]
    off = xs @ ks.transpose(-1, -2)                                              # [..., n-1, 16, ce]
    return out + F.pad(off.reshape(*lead, ce, ce), (0, SUB_TILE, SUB_TILE, 0))


def _ut_transform(k: Tensor, dec: _Decay, beta: Tensor, v: Tensor | None, dense_diag: bool
                  ) -> tuple[Tensor, Tensor | None]:
    """``[W | Uw] = (I + A)^{-1} [Diag(b)(Gamma*K) | Diag(b) V]`` per chunk. Shapes [..., C, K|V] -> W, Uw."""
    kb = k * beta[..., None]
    A = _decayed_gram(kb, k, dec, strict=True, dense_diag=dense_diag)            # strictly lower
    kbg = kb * dec.G.exp()
    rhs = kbg if v is None else torch.cat([kbg, v * beta[..., None]], -1)
    # unitriangular: the unit diagonal of I + A is implied, only the strictly lower A is read.
    sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    K = k.shape[-1]
    return (sol, None) if v is None else (sol[..., :K], sol[..., K:])


def _chunk_transition(k: Tensor, dec: _Decay, W: Tensor) -> tuple[Tensor, Tensor]:
    """Per chunk ``M = Diag(Gamma_C) - Kd^T W`` and ``Kd = K * Gamma_C / Gamma`` (factors <= 1)."""
    k_dec = k * dec.suf.exp()
    M = torch.diag_embed(dec.G[..., -1, :].exp()) - k_dec.transpose(-1, -2) @ W
    return M, k_dec


def _fold(M: Tensor, Hs: Tensor | None, layout: _Layout, S0: Tensor) -> tuple[list[Tensor], Tensor]:
    """Sequential ``S <- M_c S + H_c`` over chunk index, batched over documents (sorted, active = prefix).

    M [NC,H,K,K], Hs [NC,H,K,V] or None, S0 [N,H,K,*] (original document order). Returns the step-major list
    of entry states and the final state per document [N,H,K,*].
    """
    S_all = S0[layout.order]
    S = S_all
    entries, finals = [], []
    n_steps = len(layout.step_ids)
    for j, ids in enumerate(layout.step_ids):
        S = S[: ids.numel()]
        entries.append(S)
        S = M[ids] @ S if Hs is None else M[ids] @ S + Hs[ids]
        n_next = layout.step_ids[j + 1].numel() if j + 1 < n_steps else 0
        finals.append(S[n_next:])                           # documents whose last chunk this was
    n0 = layout.step_ids[0].numel() if n_steps else 0
    final_sorted = torch.cat(finals[::-1] + [S_all[n0:]], 0)  # + documents with no tokens
    return entries, final_sorted[layout.inv_order]


# ----------------------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------------------
def chunk_kda_autograd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                       initial_state: Tensor | None = None, output_final_state: bool = False,
                       cu_seqlens: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor | None]:
    """Chunkwise KDA, differentiable through plain torch ops (flash-linear-attention ``chunk_kda`` layout).

    The reference the hand-written backward (:mod:`k3train.ops.kda_function`, the training path) is tested
    against; it reads the decay span from the data (one host synchronisation) to pick the diagonal sub-tile path.

    Args:
        q, k: ``[B,T,H,K]`` used as given (normalise outside). v: ``[B,T,H,V]``.
        g: ``[B,T,H,K]`` natural-log decay per key channel, <= 0 (any value; see module docstring for numerics).
        beta: ``[B,T,H]``. scale: output multiplier, default ``K ** -0.5``.
        initial_state: ``[N,H,K,V]`` or None (zeros); N = B, or the number of documents with ``cu_seqlens``.
        output_final_state: return the state after each sequence's / document's last token.
        cu_seqlens: int ``[N+1]`` document offsets along T (requires B = 1); the state resets at each document.
        chunk_size: tokens per chunk, a multiple of 16 (sub-tile size).
    Returns:
        ``(o [B,T,H,V] in q's dtype, final_state [N,H,K,V] in fp32 (float64 for float64 inputs) or None)``.
    Single-device op; no process group.
    """
    n_seq = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size <= 0 or chunk_size % SUB_TILE:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB_TILE}, got {chunk_size}")
    B, T, H, K = k.shape
    Vd = v.shape[-1]
    cd = compute_dtype(q.dtype)
    scale = K ** -0.5 if scale is None else scale
    layout = _build_layout(doc_lengths(B, T, cu_seqlens), chunk_size, q.device)
    qc, kc, vc, gc, bc = (_to_chunks(x, layout, chunk_size, cd) for x in (q, k, v, g, beta))
    qc = qc * scale

    dec = _decay_sums(gc)
    dense = dec.span <= _DENSE_SPAN_MAX[cd]
    W, Uw = _ut_transform(kc, dec, bc, vc, dense)
    P = _decayed_gram(qc, kc, dec, strict=False, dense_diag=dense)               # [NC,H,C,C]
    o_intra = P @ Uw
    q_eff = qc * dec.G.exp() - P @ W
    M, k_dec = _chunk_transition(kc, dec, W)
    Hs = k_dec.transpose(-1, -2) @ Uw                                            # [NC,H,K,V]

    S0 = (initial_state.to(cd) if initial_state is not None
          else q.new_zeros(n_seq, H, K, Vd, dtype=cd))
    entries, final = _fold(M, Hs, layout, S0)
    S_entry = torch.cat(entries, 0)[layout.entry_inv] if entries else S0[:0]    # [NC,H,K,V], chunk-id order
    o = o_intra + q_eff @ S_entry                                                # [NC,H,C,V]
    o = o.transpose(1, 2).reshape(-1, H, Vd)[layout.scatter]                      # real tokens only
    return o.reshape(B, T, H, Vd).to(q.dtype), (final if output_final_state else None)


def kda_transition(k: Tensor, g: Tensor, beta: Tensor, *, cu_seqlens: Tensor | None = None,
                   chunk_size: int = 64) -> Tensor:
    """Cumulative KDA state transition ``M = M_T ... M_1``, ``M_t = (I - b_t k_t k_t^T) Diag(exp(g_t))``.

    For KCP: the state after a segment is ``M S_in + S~`` with ``S~`` the zero-start final state of
    :func:`chunk_kda`. Computed per chunk from the WY representation (``Diag(Gamma_C) - Kd^T W``), then multiplied
    over chunks; fp32 (float64 stays float64), differentiable.

    Shapes: k, g ``[B,T,H,K]``, beta ``[B,T,H]`` -> ``[N,H,K,K]`` (N = B, or documents with ``cu_seqlens``,
    which requires B = 1). An empty document gives the identity. Single-device op; no process group.
    """
    n_seq = check_kda_inputs(None, k, None, g, beta, None, cu_seqlens)
    if chunk_size <= 0 or chunk_size % SUB_TILE:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB_TILE}, got {chunk_size}")
    B, T, H, K = k.shape
    cd = compute_dtype(k.dtype)
    layout = _build_layout(doc_lengths(B, T, cu_seqlens), chunk_size, k.device)
    kc, gc, bc = (_to_chunks(x, layout, chunk_size, cd) for x in (k, g, beta))
    dec = _decay_sums(gc)
    W, _ = _ut_transform(kc, dec, bc, None, dec.span <= _DENSE_SPAN_MAX[cd])
    M, _ = _chunk_transition(kc, dec, W)
    eye = torch.eye(K, dtype=cd, device=k.device).expand(n_seq, H, K, K)
    return _fold(M, None, layout, eye)[1]
