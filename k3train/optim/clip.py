"""Global gradient norm over sharded gradients, and clipping.

Every optimised parameter has exactly one *owner* rank in the group its gradient is reduced over (see
:mod:`k3train.optim.zero`). Only the owner adds ``||g||^2`` to its local sum, so summing the local sums over
``norm_groups`` counts every parameter once whatever the layout:

* ``dp_cp`` of a pipeline stage contains every owner of that stage's dense parameters and -- because an EDP group
  and the EP groups together tile ``dp_cp`` -- one owner of every distinct routed-expert shard;
* ``pp`` joins stages, which hold disjoint parameters.
Summing over ``dp_cp`` first and ``pp`` second therefore gives the global squared norm on every rank.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist


def local_sq_norm(grads: Iterable[torch.Tensor | None], device: torch.device | None = None) -> torch.Tensor:
    """Sum of squared entries of ``grads`` (None skipped), as a float64 scalar on ``device``."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g is not None:
            total += torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double().square().to(total.device)
    return total


def global_norm(local_sq: torch.Tensor, norm_groups: Sequence[Any]) -> float:
    """``sqrt`` of ``local_sq`` SUM-all-reduced over each group of ``norm_groups`` in turn (None groups skipped)."""
    t = local_sq.clone()
    for g in norm_groups:
        if g is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)
    return math.sqrt(float(t))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Scale to apply to gradients so their global norm is at most ``max_norm`` (1.0 when no clipping)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


@torch.no_grad()
def scale_grads_(grads: Iterable[torch.Tensor | None], coef: float) -> None:
    """Multiply every non-None gradient in place by ``coef``."""
    if coef == 1.0:
        return
    gs = [g for g in grads if g is not None]
    if gs:
        torch._foreach_mul_(gs, coef)
