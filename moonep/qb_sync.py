"""Quantile Balancing across ranks: one SUM all-reduce of every router's statistics per optimizer step.

Every rank that routes tokens for a layer -- its data-parallel, context-parallel and expert-parallel peers, i.e.
the ``dp_cp`` group of the pipeline stage -- accumulates the router's integer statistics (expert loads, per-expert
histograms of ``alpha_i - s_ij``) over its micro-batches. Summing them gives the statistics of the global batch,
so every rank's ``balance_step()`` computes the same global-batch quantile and the same bias (a persistent
buffer, checkpointed with the model). The histogram bins are aligned across ranks because their range depends
only on the bias, which is already identical everywhere.

Communication: the statistics of all routers of this rank's chunks are concatenated per dtype and reduced with
ONE all-reduce per dtype (``n_layers x E x (bins + 1)`` int32 for QB), over ``dims.group('dp_cp')``.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from k3train.model.moe import Router


def _routers(model: nn.Module | Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    mods = [model] if isinstance(model, nn.Module) else list(model)
    return [(name, m) for mod in mods for name, m in mod.named_modules() if isinstance(m, Router)]


def all_reduce_router_stats(model: nn.Module | Iterable[nn.Module], group: Any) -> int:
    """SUM-all-reduce every router's ``balance_stats()`` in place over ``group`` (one call per dtype).
    Returns the number of elements reduced. Collective over ``group`` (no-op when None)."""
    stats = [t for _, r in _routers(model) for t in r.balance_stats()]
    if group is None or not stats:
        return 0
    total = 0
    for dtype in sorted({t.dtype for t in stats}, key=str):
        same = [t for t in stats if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        total += flat.numel()
    return total


@torch.no_grad()
def sync_router_balance(model: nn.Module | Iterable[nn.Module], dims: Any) -> dict[str, Any]:
    """Once per optimizer step, after the last micro-batch's backward: all-reduce the routers' statistics over
    ``dims.group('dp_cp')`` and call every router's ``balance_step()`` (new bias for the NEXT step).

    Returns metrics: ``router/{fqn}/maxvio``, ``router/{fqn}/bias_absmax`` per router and
    ``router/maxvio_max``, ``router/maxvio_mean``, ``router/stats_elements`` (elements all-reduced).
    """
    routers = _routers(model)
    n_elems = all_reduce_router_stats(model, dims.group("dp_cp"))
    out: dict[str, Any] = {"router/stats_elements": n_elems}
    vios = []
    for name, r in routers:
        m = r.balance_step()
        out[f"router/{name}/maxvio"] = m["maxvio"]
        out[f"router/{name}/bias_absmax"] = m["bias_absmax"]
        vios.append(m["maxvio"])
    if vios:
        out["router/maxvio_max"] = float(np.max(vios))
        out["router/maxvio_mean"] = float(np.mean(vios))
    return out
