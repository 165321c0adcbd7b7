"""Collectives on the links a group spans: ring formulas and per-call costs."""
from __future__ import annotations

from typing import Any

from k3train.planning.step_time.device import Device


def node_of(rank: int, dev: Device) -> int:
    return rank // max(1, dev.gpus_per_node)


def group_link(ranks: Any, dev: Device) -> tuple[float, float]:
    """The link of a group given as an increasing rank sequence: inside a node iff its first and last rank are."""
    return dev.link(node_of(ranks[0], dev) == node_of(ranks[-1], dev))


def ring_time(kind: str, nbytes: float, ranks: Any, dev: Device, calls: int = 1) -> float:
    """``kind``: 'all_reduce' | 'all_gather' | 'reduce_scatter' | 'all_to_all' (``nbytes``: the full buffer of one
    rank; all-gather: the gathered result), issued as ``calls`` collective calls (each pays ``dev.call_cost(kind)``)."""
    n = len(ranks)
    if n <= 1 or calls <= 0:
        return 0.0
    lat, bw = group_link(ranks, dev)
    fixed = calls * dev.call_cost(kind)
    if kind == "all_reduce":
        return fixed + calls * 2 * (n - 1) * lat + 2 * (n - 1) / n * max(0.0, nbytes) / bw
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return fixed + calls * (n - 1) * lat + (n - 1) / n * max(0.0, nbytes) / bw
    raise ValueError(kind)
