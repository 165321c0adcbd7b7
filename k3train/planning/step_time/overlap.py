"""What of a layer's communication is exposed: one thread's computes and transfers executed on the rank's link,
in the order moonep/dispatcher.py issues them."""
from __future__ import annotations

from typing import Any


def side_timeline(ops: list[tuple], in_line: bool = False) -> tuple[list[tuple[str, float]], dict[str, float]]:
    """One thread's program of computes and transfers, executed: ``('c', s)`` computes ``s`` seconds; ``('start',
    name, kind, s)`` starts a transfer of ``s`` link-seconds (async); ``('wait', name)`` blocks until it is done;
    ``('sync', kind, s)`` is a start and its wait. Transfers in flight share the rank's link equally and run while
    the thread computes. Returns the phases the thread spends (``('c', s)`` computing, ``('n', s)`` blocked in a
    wait, consecutive ones merged) and the blocked seconds by the kind of the transfer waited for; transfers still
    in flight at the end are waited for there, in start order. ``in_line``: every transfer is waited for as soon
    as it starts (a host whose ranks share its cores: computing ranks leave no core for a transfer to progress on,
    and a collective waits for descheduled peers -- what ``Device.call_cost`` measured)."""
    live: dict[str, list] = {}  # name -> [link-seconds left, kind], in start order
    phases: list[tuple[str, float]] = []
    blocked: dict[str, float] = {}

    def run(dt: float, until: str | None = None) -> float:  # advance the link; returns the seconds spent
        spent = 0.0
        while live and (until is None and dt > 0 or until is not None and until in live):
            n = len(live)
            step = min(v[0] for v in live.values()) * n
            if until is None and step > dt:
                for v in live.values():
                    v[0] -= dt / n
                return spent + dt
            for v in live.values():
                v[0] -= step / n
            for k in [k for k, v in live.items() if v[0] <= 1e-15]:
                del live[k]
            spent += step
            dt -= step
        return spent

    def add(kind: str, sec: float) -> None:
        if sec > 0.0:
            phases.append((kind, phases.pop()[1] + sec) if phases and phases[-1][0] == kind else (kind, sec))

    def wait(name: str) -> None:
        kind = live[name][1]
        t = run(0.0, until=name)
        add("n", t)
        blocked[kind] = blocked.get(kind, 0.0) + t

    for op in ops:
        if op[0] == "c":
            run(op[1])
            add("c", op[1])
        elif op[0] == "start":
            if op[3] > 0.0:
                live[op[1]] = [op[3], op[2]]
                if in_line:
                    wait(op[1])
        elif op[0] == "wait":
            if op[1] in live:
                wait(op[1])
        else:  # sync
            if op[2] > 0.0:
                live["_sync"] = [op[2], op[1]]
                wait("_sync")
    for name in list(live):
        if name in live:
            wait(name)
    return phases, blocked


def layer_ops(direction: str, sent: dict[str, tuple[float, float]], experts: float, other: float, own: float,
              split: bool, es: int) -> list[tuple]:
    """One layer's forward (``direction`` 'f') or backward ('b') as its thread issues it, for :func:`side_timeline`:
    ``sent`` the layer's in-action communication by kind as sent (:func:`comm_per_layer`), ``experts`` / ``other``
    the routed experts' and the rest's compute seconds, ``own`` the share of the expert rows the rank computes for
    its own experts (the rest are MoonEP replicas). A MoE layer follows moonep/dispatcher.py:

    * forward: the rest of the layer; the token all-to-all and the replica prefetch start together; the own
      experts once the tokens are in, the replicas once their weights are; the combine all-to-all;
    * backward: the combine's all-to-all; the next backward's replicas start travelling (prefetched ahead); the
      replicas' backward, whose fp32 weight gradients start travelling home (reduce-back); the own experts'
      backward -- under ``split`` (``parallel.expert_wgrad_split``) the input gradients first, then their
      all-to-all starts and the weight gradients are computed while it travels, else all of it and then the
      all-to-all; both transfers waited for; the rest of the layer, and the prefetch waited for at its end (the
      next layer's backward waits for it, in line).

    MoonEP's backward replica traffic (``moonep_replicas``) splits into the re-fetch (``es`` bytes per weight) and
    the reduce-back (fp32) by their bytes. KCP / MLA-CP collectives run in line, before the MoE part in the
    backward and after it in the forward."""
    i = 0 if direction == "f" else 1
    rest = [("sync", k, v[i]) for k, v in sent.items() if k not in ("ep_all_to_all", "moonep_replicas")]
    a2a, rp = sent.get("ep_all_to_all", (0.0, 0.0))[i], sent.get("moonep_replicas", (0.0, 0.0))[i]
    if a2a == 0.0:
        return [("c", other + experts)] + rest if direction == "f" else rest + [("c", other + experts)]
    mine, reps = experts * own, experts * (1.0 - own)
    if direction == "f":
        return [("c", other), ("start", "tok", "ep_all_to_all", a2a / 2), ("start", "w", "moonep_replicas", rp),
                ("wait", "tok"), ("c", mine), ("wait", "w"), ("c", reps), ("sync", "ep_all_to_all", a2a / 2)] + rest
    fetch, back = rp * es / (es + 4), rp * 4 / (es + 4)
    own_bwd = ([("c", mine / 2), ("start", "tok", "ep_all_to_all", a2a / 2), ("c", mine / 2)] if split else
               [("c", mine), ("start", "tok", "ep_all_to_all", a2a / 2)])
    return rest + [("sync", "ep_all_to_all", a2a / 2), ("start", "ahead", "moonep_replicas", fetch), ("c", reps),
                   ("start", "back", "moonep_replicas", back)] + own_bwd + [
                   ("wait", "back"), ("wait", "tok"), ("c", other), ("wait", "ahead")]


def own_row_share(lay: Any, skew: float, sent: dict[str, tuple[float, float]]) -> float:
    """The share of its ``N*k`` expert rows a rank computes for its own experts: all of them under plain EP or
    when MoonEP fetches no replica; else ``1 / skew`` (MoonEP moves the excess of the busiest ranks, about
    ``(skew - 1) / skew`` of their rows, onto replicas)."""
    if not lay.moonep or sent.get("moonep_replicas", (0.0, 0.0)) == (0.0, 0.0):
        return 1.0
    return 1.0 / max(1.0, skew)
