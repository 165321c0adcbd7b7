"""Communication accounting: bytes a rank sends / receives per step, by kind, and their sum over ranks.

Kinds used by the pipeline: ``hidden`` (AttnRes partial sums crossing a stage cut), ``block_cache`` (completed
AttnRes block sums), ``grad`` (their gradients going back). The trainer writes the all-rank sums to
``metrics.jsonl`` as ``p2p_bytes`` plus ``p2p_bytes_<kind>``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist


class ByteCounter:
    """Per-step byte counters (``sent[kind]``, ``recv[kind]``)."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = defaultdict(int)
        self.recv: dict[str, int] = defaultdict(int)

    def add_sent(self, kind: str, t: torch.Tensor) -> None:
        self.sent[kind] += t.numel() * t.element_size()

    def add_recv(self, kind: str, t: torch.Tensor) -> None:
        self.recv[kind] += t.numel() * t.element_size()

    def reset(self) -> None:
        self.sent.clear()
        self.recv.clear()

    def as_stats(self, kinds: tuple[str, ...] = ("hidden", "block_cache", "grad")) -> dict[str, int]:
        """``{'p2p_bytes': sent total, 'p2p_bytes_<kind>': sent, 'p2p_recv_bytes': received total}``."""
        out = {"p2p_bytes": sum(self.sent.values()), "p2p_recv_bytes": sum(self.recv.values())}
        for k in kinds:
            out[f"p2p_bytes_{k}"] = self.sent.get(k, 0)
        return out


def sum_over_ranks(stats: dict[str, Any], keys: list[str] | None = None, group: Any = None,
                   device: torch.device | str = "cpu") -> dict[str, float]:
    """Sum numeric ``stats[k]`` for ``k`` in ``keys`` (default: every key starting with ``p2p_``) over ``group``
    (default: the whole world) with one all-reduce. Without torch.distributed it returns the local values.

    Every rank of ``group`` must call it with the same keys (missing keys count as 0).
    """
    keys = sorted(k for k in stats if k.startswith("p2p_")) if keys is None else list(keys)
    vals = torch.tensor([float(stats.get(k, 0)) for k in keys], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(vals, group=group)
    return {k: float(v) for k, v in zip(keys, vals.tolist())}
