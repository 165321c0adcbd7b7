"""Collectives on the links a group spans: ring formulas, the all-to-all's per-peer traffic, per-call costs."""
from __future__ import annotations

from collections import Counter
from typing import Any

from k3train.planning.step_time.device import Device


def group_link(ranks: Any, dev: Device) -> tuple[float, float]:
    """The link of a group given as an increasing rank sequence: NVLink iff its first and last rank share an NVLink
    domain, else the inter-node link."""
    return dev.link(dev.domain_of(ranks[0]) == dev.domain_of(ranks[-1]))


def peers_split(ranks: Any, dev: Device) -> tuple[int, int]:
    """``(inside, outside)``: the peers of the group's rank with the fewest of them in its own NVLink domain (the
    one whose NIC carries the most), inside its domain and outside it."""
    key = (tuple(ranks) if not isinstance(ranks, range) else ranks, id(dev))
    if key not in _PEERS:  # memoised: the planner asks for the same few groups hundreds of thousands of times
        per_domain = Counter(dev.domain_of(r) for r in ranks)
        mine = min(per_domain.values())
        _PEERS[key] = ((mine - 1, len(ranks) - mine), dev)  # the device kept alive: its id stays its own
    return _PEERS[key][0]


_PEERS: dict[tuple, Any] = {}


def ring_time(kind: str, nbytes: float, ranks: Any, dev: Device, calls: int = 1) -> float:
    """``kind``: 'all_reduce' | 'all_gather' | 'reduce_scatter' | 'all_to_all' (``nbytes``: the full buffer of one
    rank; all-gather: the gathered result), issued as ``calls`` collective calls (each pays ``dev.call_cost(kind)``).
    The ring collectives run at the slowest link the group spans; the all-to-all is NCCL's (and gloo's) one
    point-to-point exchange with every peer at once: ``nbytes / n`` to each, the peers in the rank's NVLink domain
    over NVLink while the others go over its NIC (:func:`peers_split`), whichever takes longer."""
    n = len(ranks)
    if n <= 1 or calls <= 0:
        return 0.0
    lat, bw = group_link(ranks, dev)
    fixed = calls * dev.call_cost(kind)
    if kind == "all_reduce":
        return fixed + calls * 2 * (n - 1) * lat + 2 * (n - 1) / n * max(0.0, nbytes) / bw
    if kind in ("all_gather", "reduce_scatter"):
        return fixed + calls * (n - 1) * lat + (n - 1) / n * max(0.0, nbytes) / bw
    if kind == "all_to_all":
        inside, outside = peers_split(ranks, dev)
        per_peer = max(0.0, nbytes) / n
        wire = max(inside * per_peer / dev.link(True)[1], outside * per_peer / dev.link(False)[1])
        return fixed + calls * (n - 1) * lat + wire
    raise ValueError(kind)
