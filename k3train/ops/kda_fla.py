"""KDA through flash-linear-attention's Triton kernel (``fla.ops.kda.chunk_kda``), with k3train's op signature.

:func:`fla_chunk_kda` takes exactly what :func:`k3train.ops.kda.chunk_kda` takes and returns the same
``(o, final_state)``, so ``KDALayer.kda_op`` can be either (k3train/model/kernels.py picks; CUDA only)::

    q, k, g [B,T,H,K]   v [B,T,H,V]   beta [B,T,H]   initial_state [N,H,K,V]   o [B,T,H,V] (q's dtype)
    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,   o_t = scale * S_t^T q_t

Conventions, checked against fla's ``chunk_kda`` (fla/ops/kda/chunk.py):

* ``g`` is the per-channel log decay in natural log (fla multiplies by 1/ln2 and uses exp2 internally), same as
  ours; the state layout ``[N, H, K, V]`` (``state_v_first=False``) and varlen ``cu_seqlens`` with ``B = 1`` are
  the same. fla asserts a long ``cu_seqlens`` and an fp32 ``initial_state``: converted here.
* The gate stays OUTSIDE the kernel (``use_gate_in_kernel=False``): the layer computes K3's
  ``g = g_min * sigmoid(exp(A_h) * z)`` (k3train/model/kda.py: kda_decay) in fp32 and autograd carries ``dg`` to
  ``A_log`` and the decay projection. fla's in-kernel gate with ``lower_bound`` set computes
  ``lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))`` -- the same function with ``g_raw = W_a_up W_a_down x``
  and ``dt_bias = b_a`` -- a possible later fusion; the softplus ablation and KCP need the explicit ``g`` anyway.
* ``safe_gate=True`` tells the kernel every ``g >= -5`` so it may use its M=16 tensor-core sub-tiles (fla's own
  varlen test runs it so, on a precomputed ``g`` clamped to ``[-5, 0]``; ``lower_bound`` only parameterises the
  in-kernel gate and is not passed). K3's lower-bounded gate guarantees ``g in (g_min, 0)``: safe for
  ``g_min in [-5, 0)``; any other bound, or the unbounded softplus gate (``g_lower_bound=None``), runs with
  ``safe_gate=False``.
* ``beta`` is passed in q's dtype (the layer computes it in fp32; fla's kernels and tests take it in the
  activation dtype); autograd returns its gradient in fp32.
* fla chunks by 64 tokens regardless of ``model.kda_chunk_size`` (the result is the same math; only rounding
  differs).

KCP does not use this op: it needs each segment's ``(M, S~)`` (k3train/ops/kda.py: kda_transition).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fla_chunk_kda", "fla_safe_gate"]


def fla_safe_gate(g_lower_bound: float | None) -> bool:
    """Whether fla's ``safe_gate`` applies: a guaranteed bound within the range fla accepts, ``[-5, 0)``."""
    return g_lower_bound is not None and -5.0 <= g_lower_bound < 0.0


def fla_chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                  initial_state: Tensor | None = None, output_final_state: bool = False,
                  cu_seqlens: Tensor | None = None, g_lower_bound: float | None = None,
                  chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_kda`` with k3train's arguments (shapes in the module docstring). ``chunk_size`` is accepted
    for signature parity and ignored (fla uses 64). Returns ``(o in q's dtype, final_state fp32 or None)``."""
    del chunk_size
    if q.device.type != "cuda":
        raise RuntimeError(f"fla_chunk_kda: fla's kernel needs CUDA tensors, got {q.device}")
    # lazy: flash-linear-attention is optional (CUDA + triton)
    from fla.ops.kda import chunk_kda  # CUDA only; imported on first call so CPU machines never import triton

    safe = fla_safe_gate(g_lower_bound)
    if q.dtype in (torch.bfloat16, torch.float16):
        beta = beta.to(q.dtype)
    o, final = chunk_kda(
        q, k, v, g, beta,
        scale=scale if scale is not None else q.shape[-1] ** -0.5,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        # left at fla's defaults (not passed, so older fla releases take the call too): use_qk_l2norm_in_kernel
        # (the layer L2-normalises q and k), use_gate_in_kernel (g is the log decay itself, module docstring),
        # use_beta_sigmoid_in_kernel (beta is already sigmoid(W_b x))
        safe_gate=safe,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
    )
    return o, (final if output_final_state else None)
