"""KDA (Kimi Delta Attention) core op: public entry points.

``chunk_kda`` is the training path (chunkwise, batched, fp32 accumulation, one ``autograd.Function`` with a
hand-written chunked backward; :mod:`k3train.ops.kda_function`), ``chunk_kda_autograd`` the same chunk math
differentiated by autograd (:mod:`k3train.ops.kda_chunk`, the reference its tests compare against), and
``naive_recurrent_kda`` the readable token-loop reference (:mod:`k3train.ops.kda_naive`); all use the
flash-linear-attention layout and semantics::

    q, k, g [B,T,H,K]   v [B,T,H,V]   beta [B,T,H]   state [N,H,K,V]   o [B,T,H,V]
    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,   o_t = scale * S_t^T q_t

``kda_transition`` gives the cumulative transition ``M_T ... M_1`` per sequence / document (for KDA context
parallelism); ``naive_kda_transition`` is its explicit-product reference.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from .kda_chunk import SUB_TILE, chunk_kda_autograd, kda_transition
from .kda_function import chunk_kda_function as chunk_kda
from .kda_function import dense_diagonal_ok
from .kda_naive import naive_kda_transition, naive_recurrent_kda

__all__ = ["chunk_kda", "chunk_kda_autograd", "naive_recurrent_kda", "kda_transition", "naive_kda_transition",
           "dense_diagonal_ok", "layer_kda_op", "SUB_TILE"]


def layer_kda_op(model_cfg: Any) -> Callable[..., Any]:
    """``chunk_kda`` as the KDA layer and KCP call it (one definition, so both run the same numerics).

    The config's chunk size, and the gate's lower bound when the decay parameterisation guarantees one (K3's
    ``lower_bounded`` gate: g > ``gate_lower_bound``), which selects the dense diagonal sub-tiles without reading
    any tensor value; the ``softplus`` gate has no bound (exact pairwise diagonal tiles).
    """
    bound = float(model_cfg.gate_lower_bound) if model_cfg.kda_decay_form == "lower_bounded" else None
    return functools.partial(chunk_kda, chunk_size=model_cfg.kda_chunk_size, g_lower_bound=bound)
