"""The AttnRes aggregation + pre-norm as one autograd function with a hand-written backward (``attn_res_recompute``).

Reference: :func:`k3train.model.attnres.attn_res_aggregate` followed by the pre-norm, through autograd (the tests
compare outputs and every gradient against it, tests/model/test_attnres.py). Same maths, reordered so that no
``[N, B, T, d]`` tensor is ever built (the reference stacks the sources and key-normalises all of them)::

    u = w_key * query                                  [d]
    r_i = rsqrt(mean(s_i^2) + eps_key),  p_i = s_i . u       logit_i = r_i p_i          [B, T] each
    alpha = softmax_i(logit),  h = sum_i alpha_i s_i,  y = v_pre * h * rsqrt(mean(h^2) + eps_pre)

Forward reads each source about three times. Backward saves only ``alpha``, ``r``, ``p`` (``[N, B, T]``) and the
pre-norm's ``rsqrt`` (``[B, T]``) besides references to the sources, which stay resident anyway (completed blocks,
the partial sum): ``h`` is rebuilt from them (one pass per source) instead of kept. So per sublayer autograd keeps
what the checkpointed reference keeps (the sources) plus ``3N + 1`` scalars per token, and the aggregation runs
once in forward instead of twice -- and three times under ``parallel.recompute``, where the checkpoint nested in
the chunk's checkpoint re-ran it once more. Arithmetic in at least fp32 (fp64 for fp64 runs), the output in the
sources' dtype.

:func:`rms_norm` is the same for the standard residual's pre-norm (the ablation compares like with like): it keeps
its input (the residual stream, resident) and ``rsqrt`` per token, not the fp32 intermediates.
"""
from __future__ import annotations

import torch
from torch import nn


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _norm_fwd(h: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(h^2) + eps)`` over the last dim, ``[..., 1]`` (h in the accumulation dtype)."""
    d = h.shape[-1]
    return torch.rsqrt(torch.linalg.vector_norm(h, dim=-1, keepdim=True).square_().div_(d).add_(eps))


def _norm_bwd(g: torch.Tensor, hhat: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """Gradient into ``h`` of ``hhat = h * rho`` given the gradient ``g`` of ``hhat`` (RMSNorm without weight)."""
    d = hhat.shape[-1]
    c = (g * hhat).sum(-1, keepdim=True).div_(d)
    return (g - hhat * c).mul_(rho)


class _AggregateNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, wk: torch.Tensor, vp: torch.Tensor | None, eps_k: float,  # noqa: ANN001
                eps_p: float, *sources: torch.Tensor) -> torch.Tensor:
        dt = sources[0].dtype
        acc = _acc(dt)
        u = wk.to(acc) * q.to(acc)
        r, p = [], []
        for s in sources:
            sf = s.to(acc)
            r.append(_norm_fwd(sf, eps_k).squeeze(-1))
            p.append(sf @ u)
        r_, p_ = torch.stack(r), torch.stack(p)  # [N, B, T]
        alpha = torch.softmax(r_ * p_, dim=0)
        h = _weighted_sum(sources, alpha, acc)
        if vp is not None:
            rho = _norm_fwd(h, eps_p)
            y = (h * rho).mul_(vp.to(acc))
        else:
            rho, y = None, h
        ctx.save_for_backward(q, wk, vp, alpha, r_, p_, rho, *sources)
        ctx.has_norm = vp is not None
        return y.to(dt)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # noqa: ANN001, ANN205
        q, wk, vp, alpha, r_, p_, rho, *sources = ctx.saved_tensors
        acc = _acc(sources[0].dtype)
        d = sources[0].shape[-1]
        g = gy.to(acc)
        dvp = None
        if ctx.has_norm:
            hhat = _weighted_sum(sources, alpha, acc).mul_(rho)  # rebuilt, not kept
            if ctx.needs_input_grad[2]:
                dvp = (g * hhat).reshape(-1, d).sum(0).to(vp.dtype)
            dh = _norm_bwd(g * vp.to(acc), hhat, rho)
            del hhat
        else:
            dh = g
        da = torch.stack([(dh * s.to(acc)).sum(-1) for s in sources])  # dL/dalpha_i = dh . s_i   [N, B, T]
        dl = alpha * (da - (alpha * da).sum(0, keepdim=True))  # softmax backward -> dL/dlogit
        c1 = dl * r_  # d logit_i / d s_i = r_i u - p_i r_i^3 s_i / d
        c2 = c1 * p_ * r_ * r_ / d
        u = wk.to(acc) * q.to(acc)
        dsrc, du = [], torch.zeros(d, dtype=acc, device=g.device)
        for i, s in enumerate(sources):
            sf = s.to(acc)
            ds = dh * alpha[i].unsqueeze(-1)
            ds.addcmul_(c1[i].unsqueeze(-1), u).addcmul_(sf, c2[i].unsqueeze(-1), value=-1.0)
            dsrc.append(ds.to(s.dtype))
            du += sf.reshape(-1, d).t() @ c1[i].reshape(-1)
        dq = (du * wk.to(acc)).to(q.dtype) if ctx.needs_input_grad[0] else None
        dwk = (du * q.to(acc)).to(wk.dtype) if ctx.needs_input_grad[1] else None
        return (dq, dwk, dvp, None, None, *dsrc)


def _weighted_sum(sources: tuple[torch.Tensor, ...] | list[torch.Tensor], alpha: torch.Tensor,
                  acc: torch.dtype) -> torch.Tensor:
    h = sources[0].to(acc) * alpha[0].unsqueeze(-1)
    for i in range(1, len(sources)):
        h.addcmul_(sources[i].to(acc), alpha[i].unsqueeze(-1))
    return h


def aggregate_norm(sources: list[torch.Tensor], query: torch.Tensor, key_norm: nn.Module,
                   pre_norm: nn.Module | None) -> torch.Tensor:
    """``pre_norm(attn_res_aggregate(sources, query, key_norm))`` (``pre_norm`` an RMSNorm or None), keeping only
    per-token scalars for backward (module docstring)."""
    vp = pre_norm.weight if pre_norm is not None else None
    eps_p = pre_norm.eps if pre_norm is not None else 0.0
    return _AggregateNorm.apply(query, key_norm.weight, vp, key_norm.eps, eps_p, *sources)


class _RMSNormKeepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: ANN001
        acc = _acc(x.dtype)
        xf = x.to(acc)
        rho = _norm_fwd(xf, eps)
        ctx.save_for_backward(x, w, rho)
        return (xf * rho).mul_(w.to(acc)).to(x.dtype)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # noqa: ANN001, ANN205
        x, w, rho = ctx.saved_tensors
        acc = _acc(x.dtype)
        g = gy.to(acc)
        xhat = x.to(acc) * rho
        dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        dx = _norm_bwd(g * w.to(acc), xhat, rho).to(x.dtype)
        return dx, dw, None


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``norm(x)`` (an RMSNorm) keeping only ``x`` and one ``rsqrt`` per token for backward."""
    return _RMSNormKeepInput.apply(x, norm.weight, norm.eps)
