"""Readable token-by-token reference for KDA (Kimi Delta Attention).

Per head, with ``d_k x d_v`` state ``S``, the recurrence (flash-linear-attention semantics: decay first, then the
delta-rule update; the output reads the *updated* state) is::

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T
    o_t = scale * S_t^T q_t

This file is the ground truth the chunked training kernel (:mod:`k3train.ops.kda_chunk`) is tested against. It is
slow (a Python loop over tokens) and meant for tests, inference-style stepping and benchmarks only.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["naive_recurrent_kda", "naive_kda_transition", "check_kda_inputs", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else (bf16, fp16, fp32) computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_kda_inputs(q: Tensor | None, k: Tensor, v: Tensor | None, g: Tensor, beta: Tensor,
                     initial_state: Tensor | None, cu_seqlens: Tensor | None) -> int:
    """Validate shapes (flash-linear-attention layout); return the number of sequences N (rows or documents).

    Raises ValueError naming the offending argument.
    """
    if k.dim() != 4:
        raise ValueError(f"k must be [B,T,H,K], got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q must have the shape of k {tuple(k.shape)}, got {tuple(q.shape)}")
    if g.shape != k.shape:
        raise ValueError(f"g must have the shape of k {tuple(k.shape)}, got {tuple(g.shape)}")
    if v is not None and (v.dim() != 4 or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"v must be [B,T,H,V] with B,T,H = {(B, T, H)}, got {tuple(v.shape)}")
    if beta.shape != k.shape[:3]:
        raise ValueError(f"beta must be [B,T,H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if cu_seqlens is None:
        n = B
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1 (flattened documents), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1], got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {cu}")
        n = len(cu) - 1
    if initial_state is not None:
        Vd = v.shape[-1] if v is not None else initial_state.shape[-1]
        if initial_state.shape != (n, H, K, Vd):
            raise ValueError(f"initial_state must be [N,H,K,V] = {(n, H, K, Vd)}, got {tuple(initial_state.shape)}")
    return n


def _recurrent_one(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   state: Tensor) -> tuple[Tensor, Tensor]:
    """One sequence of T tokens: q,k,g [T,H,K], v [T,H,V], beta [T,H], state [H,K,V] -> (o [T,H,V], state)."""
    outs = []
    for t in range(k.shape[0]):
        state = state * g[t].exp()[..., None]                                   # Diag(exp(g_t)) S_{t-1}
        pred = torch.einsum("hk,hkv->hv", k[t], state)                          # k_t^T (decayed state)
        delta = beta[t][:, None] * (v[t] - pred)                                # b_t (v_t - k_t^T S)
        state = state + k[t][:, :, None] * delta[:, None, :]                    # ... + k_t delta^T
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))            # reads the updated state
    o = torch.stack(outs, 0) if outs else v.new_zeros(0, *v.shape[1:])
    return o, state


def naive_recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                        initial_state: Tensor | None = None, output_final_state: bool = False,
                        cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Token-loop KDA reference (same signature and semantics as :func:`k3train.ops.kda.chunk_kda`).

    Args:
        q, k: ``[B,T,H,K]`` (used as given; no normalisation here). v: ``[B,T,H,V]``.
        g: ``[B,T,H,K]`` natural-log decay per key channel (<= 0). beta: ``[B,T,H]``.
        scale: multiplies the output; default ``K ** -0.5``.
        initial_state: ``[N,H,K,V]`` (N = B, or the number of documents with ``cu_seqlens``) or None (zeros).
        output_final_state: return the state after the last token of every sequence/document.
        cu_seqlens: int ``[N+1]`` document offsets over the T axis (requires B = 1); state resets at each start.
    Returns:
        ``(o [B,T,H,V] in q's dtype, final_state [N,H,K,V] in the compute dtype or None)``.
    No process group is involved.
    """
    n = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = k.shape
    Vd = v.shape[-1]
    in_dtype, cd = q.dtype, compute_dtype(q.dtype)
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(cd) for x in (q, k, v, g, beta))
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[i], cu[i + 1]) for i in range(n)]
    outs, finals = [], []
    for i, (b, s, e) in enumerate(spans):
        h0 = k.new_zeros(H, K, Vd) if initial_state is None else initial_state[i].to(cd)
        o_i, h_i = _recurrent_one(q[b, s:e], k[b, s:e], v[b, s:e], g[b, s:e], beta[b, s:e], scale, h0)
        outs.append(o_i)
        finals.append(h_i)
    o = torch.stack(outs, 0) if cu_seqlens is None else torch.cat(outs, 0)[None]
    final = torch.stack(finals, 0) if output_final_state else None
    return o.reshape(B, T, H, Vd).to(in_dtype), final


def naive_kda_transition(k: Tensor, g: Tensor, beta: Tensor, *, cu_seqlens: Tensor | None = None) -> Tensor:
    """Explicit product ``M = M_T ... M_1``, ``M_t = (I - b_t k_t k_t^T) Diag(exp(g_t))``, token by token.

    Shapes: k, g ``[B,T,H,K]``, beta ``[B,T,H]`` -> ``[N,H,K,K]`` (N = B, or documents with ``cu_seqlens``).
    """
    n = check_kda_inputs(None, k, None, g, beta, None, cu_seqlens)
    B, T, H, K = k.shape
    cd = compute_dtype(k.dtype)
    k, g, beta = (x.to(cd) for x in (k, g, beta))
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[i], cu[i + 1]) for i in range(n)]
    eye = torch.eye(K, dtype=cd, device=k.device).expand(H, K, K)
    mats = []
    for b, s, e in spans:
        m = eye
        for t in range(s, e):
            kt, bt = k[b, t], beta[b, t]
            m_t = (eye - bt[:, None, None] * kt[:, :, None] * kt[:, None, :]) * g[b, t].exp()[:, None, :]
            m = m_t @ m
        mats.append(m)
    return torch.stack(mats, 0)
