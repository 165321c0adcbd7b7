"""KDA (Kimi Delta Attention) core op: public entry points.

``chunk_kda`` is the training path (chunkwise, batched, fp32 accumulation; :mod:`k3train.ops.kda_chunk`),
``naive_recurrent_kda`` the readable token-loop reference (:mod:`k3train.ops.kda_naive`); both use the
flash-linear-attention layout and semantics::

    q, k, g [B,T,H,K]   v [B,T,H,V]   beta [B,T,H]   state [N,H,K,V]   o [B,T,H,V]
    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,   o_t = scale * S_t^T q_t

``kda_transition`` gives the cumulative transition ``M_T ... M_1`` per sequence / document (for KDA context
parallelism); ``naive_kda_transition`` is its explicit-product reference.
"""
from __future__ import annotations

from .kda_chunk import SUB_TILE, chunk_kda, kda_transition
from .kda_naive import naive_kda_transition, naive_recurrent_kda

__all__ = ["chunk_kda", "naive_recurrent_kda", "kda_transition", "naive_kda_transition", "SUB_TILE"]
