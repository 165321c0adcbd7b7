"""Per-parameter update rules: (Per-Head) Muon for matrices, AdamW for everything else.

These functions touch one parameter's tensors and nothing else -- no process group. The ZeRO layer
(:mod:`k3train.optim.zero`) decides which rank calls them for which parameter.

Muon (Moonlight / Kimi K2 form), for a matrix parameter W with gradient G and momentum buffer M:

    M <- mu M + G                          (momentum, mu = optim.muon_momentum)
    D <- G + mu M   (Nesterov)  or  M      (optim.muon_nesterov)
    O <- NS(D)  per Newton-Schulz block    (whole matrix, per head block, or per stacked expert)
    W <- W (1 - lr wd) - lr * 0.2 sqrt(max(m, n)) O

``[m, n]`` is the shape of the block that was orthogonalised. An orthogonalised ``[m, n]`` block has
``||O||_F^2 = min(m, n)``, i.e. RMS ``1/sqrt(max(m, n))``; the factor ``0.2 sqrt(max(m, n))`` brings every
block's update RMS to ~0.2, the typical RMS of an AdamW update, so Muon and AdamW share one learning rate and
one weight decay (Moonlight's rule). For Per-Head Muon the block is one head's ``[head_rows, in]`` slice, so each
head's update has the same RMS regardless of how large its momentum is -- that is the point of K3's change:
with whole-matrix orthogonalisation the heads with large momentum dominate the shared singular directions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .newton_schulz import newton_schulz
from .param_groups import ParamInfo

MUON_RMS_SCALE = 0.2


@dataclass
class HParams:
    """Hyper-parameters of one optimizer step (taken from ``OptimConfig``; ``lr`` from the schedule)."""
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    muon_momentum: float
    muon_nesterov: bool
    ns_steps: int
    ns_dtype: str

    @classmethod
    def from_config(cls, ocfg, lr: float) -> "HParams":
        return cls(lr=lr, weight_decay=ocfg.weight_decay, adam_beta1=ocfg.adam_beta1, adam_beta2=ocfg.adam_beta2,
                   adam_eps=ocfg.adam_eps, muon_momentum=ocfg.muon_momentum, muon_nesterov=ocfg.muon_nesterov,
                   ns_steps=ocfg.ns_steps, ns_dtype=ocfg.ns_dtype)


def _scale(rows: int, cols: int) -> float:
    return MUON_RMS_SCALE * math.sqrt(max(rows, cols))


def muon_direction(d: torch.Tensor, info: ParamInfo, ns_steps: int, ns_dtype: str) -> torch.Tensor:
    """Orthogonalised, RMS-scaled update direction for ``d`` (``param.shape``); float32 result.

    Whole matrix: one NS call on ``[1, m, n]``. Per head: ``d`` viewed as ``[H, head_rows, in]``; all heads of
    one segment size go through ONE batched NS call. Stacked ``[E, a, b]``: one batched call over E.
    """
    if info.layout == "stacked":
        _, a, b = d.shape
        return newton_schulz(d, ns_steps, ns_dtype).float().mul_(_scale(a, b))
    h, r, n_in = info.heads, info.head_rows, d.shape[1]
    view = d.reshape(h, r, n_in)
    if len(info.segments) == 1:
        return newton_schulz(view, ns_steps, ns_dtype).float().mul_(_scale(r, n_in)).reshape(d.shape)
    out = torch.empty(h, r, n_in, dtype=torch.float32, device=d.device)
    offsets = [sum(info.segments[:i]) for i in range(len(info.segments))]
    for size in sorted(set(info.segments)):
        offs = [o for o, s in zip(offsets, info.segments) if s == size]
        blocks = torch.cat([view[:, o:o + size] for o in offs], dim=0)          # [H * len(offs), size, in]
        ortho = newton_schulz(blocks, ns_steps, ns_dtype).float().mul_(_scale(size, n_in))
        for j, o in enumerate(offs):
            out[:, o:o + size] = ortho[j * h:(j + 1) * h]
    return out.reshape(d.shape)


def muon_step_(w: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, hp: HParams, info: ParamInfo) -> None:
    """In-place Muon update of the float32 weight ``w`` (the parameter or its master copy) and ``momentum``."""
    momentum.mul_(hp.muon_momentum).add_(grad)
    d = grad.add(momentum, alpha=hp.muon_momentum) if hp.muon_nesterov else momentum
    update = muon_direction(d, info, hp.ns_steps, hp.ns_dtype)
    if hp.weight_decay:
        w.mul_(1.0 - hp.lr * hp.weight_decay)
    w.add_(update, alpha=-hp.lr)


def adamw_step_(w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: torch.Tensor, hp: HParams, decay: bool) -> None:
    """In-place AdamW (decoupled weight decay) of float32 ``w``; ``step`` is a 0-d float tensor, incremented."""
    step.add_(1)
    t = float(step.item())
    b1, b2 = hp.adam_beta1, hp.adam_beta2
    exp_avg.mul_(b1).add_(grad, alpha=1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    bias1 = 1 - b1 ** t
    bias2 = 1 - b2 ** t
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(hp.adam_eps)
    if decay and hp.weight_decay:
        w.mul_(1.0 - hp.lr * hp.weight_decay)
    w.addcdiv_(exp_avg, denom, value=-hp.lr / bias1)
