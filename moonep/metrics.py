"""MoonEP metrics: per-layer token load before/after redundancy, replicas, bytes moved; a per-step summary.

Every rank of an EP group computes the same numbers (they come from the plan, which is built from all-gathered
counts), so rank 0 can log them without communication. Bytes are EP-group totals of the FORWARD pass:
``token_bytes`` = dispatch + combine rows that cross ranks x ``l`` x element size; ``weight_bytes`` = replica
prefetch. The backward moves the same token bytes again, fetches the replicas again unless a pool bank still holds
them (``ReplicaPool.fetches`` / ``found``), and the reduce-back moves ``weight_bytes`` (at the gradient dtype).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
from torch import nn

from moonep.planner import Plan, max_over_mean


@dataclass
class DispatchRecord:
    """One dispatch (one micro-batch of one layer)."""

    load_before: np.ndarray  # [R] routes each rank would compute without redundancy
    load_after: np.ndarray  # [R] routes each rank computes
    replicas: np.ndarray  # [R] replica experts hosted
    token_bytes: int
    weight_bytes: int

    @classmethod
    def from_plan(cls, plan: Plan, split: np.ndarray | None, row_bytes: int, expert_bytes: int,
                  cross_rows: int | None = None) -> "DispatchRecord":
        """``cross_rows`` (rows with source != destination) or the full ``split[R, R, E]`` to count them."""
        cross = cross_rows if cross_rows is not None else int(split.sum() - np.trace(split.sum(2)))
        return cls(plan.loads_before, plan.loads_after, plan.num_replicas, 2 * cross * row_bytes,
                   int(plan.num_replicas.sum()) * expert_bytes)


@dataclass
class LayerMetrics:
    """Running aggregates of one layer's dispatches since the last :meth:`pop_summary` (constant memory, so a
    caller that never collects does not leak)."""

    count: int = 0
    sum_before: float = 0.0
    sum_after: float = 0.0
    worst_before: float = 0.0
    worst_after: float = 0.0
    replicas: int = 0
    replicas_max_per_rank: int = 0
    token_bytes: int = 0
    weight_bytes: int = 0

    def add(self, rec: DispatchRecord) -> None:
        before, after = max_over_mean(rec.load_before), max_over_mean(rec.load_after)
        self.count += 1
        self.sum_before += before
        self.sum_after += after
        self.worst_before = max(self.worst_before, before)
        self.worst_after = max(self.worst_after, after)
        self.replicas += int(rec.replicas.sum())
        self.replicas_max_per_rank = max(self.replicas_max_per_rank, int(rec.replicas.max(initial=0)))
        self.token_bytes += rec.token_bytes
        self.weight_bytes += rec.weight_bytes

    def pop_summary(self) -> dict[str, float] | None:
        if self.count == 0:
            return None
        out = {
            "load_max_over_mean_before": self.sum_before / self.count,
            "load_max_over_mean_after": self.sum_after / self.count,
            "load_max_over_mean_before_worst": self.worst_before,
            "load_max_over_mean_after_worst": self.worst_after,
            "replicas_per_microbatch": self.replicas / self.count,
            "replicas_max_per_rank": float(self.replicas_max_per_rank),
            "token_bytes": float(self.token_bytes),
            "weight_bytes": float(self.weight_bytes),
            "microbatches": float(self.count),
        }
        self.__init__()  # reset
        return out


def collect_moonep_metrics(modules: nn.Module | Iterable[nn.Module], prefix: str = "moonep") -> dict[str, Any]:
    """Per-layer and step-summary metrics of every EP dispatcher in ``modules`` (model chunks); resets them.

    Keys: ``{prefix}/{layer}/{metric}`` per layer and ``{prefix}/worst_max_over_mean_before|after`` (worst
    micro-batch of the worst layer), ``{prefix}/mean_max_over_mean_before|after``, ``{prefix}/token_bytes``,
    ``{prefix}/weight_bytes``, ``{prefix}/replicas`` (step totals). No new communication; it also waits for any
    replica transfer still in flight in the dispatchers' pools (a prefetch-ahead whose backward never came: its
    peers posted it too), so the optimizer step that follows never updates a parameter while it is being sent.
    """
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    out: dict[str, Any] = {}
    layers = []
    for mod in mods:
        for name, m in mod.named_modules():
            disp = getattr(m, "dispatcher", None)
            for pool in [s.pool for s in getattr(disp, "sides", ())] or [getattr(disp, "pool", None)]:
                if pool is not None:  # every F/B-pairing side's pool (moonep.EPSide)
                    pool.drain()
            metrics = getattr(disp, "metrics", None)
            if not isinstance(metrics, LayerMetrics):
                continue
            summary = metrics.pop_summary()
            if summary is None:
                continue
            layers.append(summary)
            for key, val in summary.items():
                out[f"{prefix}/{name or 'root'}/{key}"] = val
    if layers:
        out[f"{prefix}/worst_max_over_mean_before"] = max(s["load_max_over_mean_before_worst"] for s in layers)
        out[f"{prefix}/worst_max_over_mean_after"] = max(s["load_max_over_mean_after_worst"] for s in layers)
        out[f"{prefix}/mean_max_over_mean_before"] = float(np.mean([s["load_max_over_mean_before"] for s in layers]))
        out[f"{prefix}/mean_max_over_mean_after"] = float(np.mean([s["load_max_over_mean_after"] for s in layers]))
        out[f"{prefix}/token_bytes"] = sum(s["token_bytes"] for s in layers)
        out[f"{prefix}/weight_bytes"] = sum(s["weight_bytes"] for s in layers)
        out[f"{prefix}/replicas"] = sum(s["replicas_per_microbatch"] * s["microbatches"] for s in layers)
    return out
