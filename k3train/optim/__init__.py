"""Optimizer package: Per-Head Muon + AdamW, QK-Clip, lr schedules, ZeRO-1 / Pipeline ZeRO-2.

Entry point: :func:`build_optimizer`. Protocols the model satisfies: :func:`mark_per_head`
(``param_groups.py``) for Per-Head Muon and ``qk_max`` + ``qk_clip_params()`` (``qk_clip.py``) for QK-Clip.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from torch import nn

from .newton_schulz import newton_schulz, newton_schulz_reference
from .param_groups import ParamInfo, build_param_infos, mark_per_head
from .qk_clip import QKClipTarget, qk_clip_targets
from .schedule import lr_at
from .zero import DistributedOptimizer, assign_owners

__all__ = ["build_optimizer", "DistributedOptimizer", "mark_per_head", "lr_at", "newton_schulz",
           "newton_schulz_reference", "QKClipTarget", "qk_clip_targets", "ParamInfo", "build_param_infos",
           "assign_owners"]


def build_optimizer(modules: Sequence[nn.Module] | nn.Module, cfg: Any, dims: Any,
                    param_group_fn: Callable[[str, nn.Parameter], str] | None = None, *,
                    zero: int | None = None, grad_clip: float | None = None, grad_reduce: str = "sum",
                    norm_groups: Sequence[Any] | None = None, norm_exclude: Iterable[nn.Parameter] = (),
                    log_table: bool = True) -> DistributedOptimizer:
    """Build the optimizer for the model chunks on this rank.

    Args:
        modules: model chunks on this rank (all share the full model's FQNs; a tensor in several chunks -- e.g.
            an embedding shared with MTP -- is optimised once).
        cfg: the full ``Config`` (uses ``cfg.optim``, ``cfg.parallel.zero``, ``cfg.train.grad_clip``) or just an
            ``OptimConfig`` (then pass ``zero`` and ``grad_clip``; defaults 1 and 0).
        dims: ``ParallelDims`` with groups built.
        param_group_fn: ``(fqn, param) -> group name`` the gradient is reduced and the owner chosen over
            (default ``'dp_cp'``; EP returns ``'edp'`` for routed experts).
        zero, grad_clip: override the config values.
        grad_reduce: ``'sum'`` (default; losses are normalised by the global token count) or ``'mean'``.
        norm_groups: groups the squared grad norm is summed over (default ``[dp_cp, pp]``).
        norm_exclude: parameters left out of the grad norm because another pipeline stage holds an identical
            replica that is counted (the pipeline runner's ``replica_params``).
    Returns:
        a :class:`DistributedOptimizer`: ``step(lr) -> dict(grad_norm=...)``, ``zero_grad()``,
        ``reduce_chunk_grads(params)``, ``clip_grad_norm_()``, ``state_dict()``/``load_state_dict()``,
        ``state_bytes()``, ``describe()``.
    """
    if isinstance(modules, nn.Module):
        modules = [modules]
    if hasattr(cfg, "optim"):
        ocfg = cfg.optim
        zero = cfg.parallel.zero if zero is None else zero
        grad_clip = cfg.train.grad_clip if grad_clip is None else grad_clip
    else:
        ocfg = cfg
        zero = 1 if zero is None else zero
        grad_clip = 0.0 if grad_clip is None else grad_clip
    return DistributedOptimizer(list(modules), ocfg, dims, zero=zero, grad_clip=grad_clip, group_fn=param_group_fn,
                                grad_reduce=grad_reduce, norm_groups=norm_groups, log_table=log_table,
                                norm_exclude=norm_exclude)
