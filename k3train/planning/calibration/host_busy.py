"""How much of the machine other processes took while this one measured.

A timing is only as good as the machine was idle while it was taken: on a 2-core host one other busy process
makes every per-layer time, the concurrency curve and the trainer anchor slower by up to 2x, and a calibration
taken so predicts every layout too slow from then on (it is cached). :class:`OthersCpu` measures it directly: the
machine's busy CPU time (``/proc/stat``) less this process's and all its descendants' own
(``getrusage`` and ``/proc/PID/stat``), over the wall time -- the cores that something else used. The planner keeps a calibration only
when that stayed under :data:`IDLE_OTHERS_CORES` (``tools/plan.py``), marks each ``--measure`` run by it, and
``make bench`` refuses a run above it (``benchmarks/bench_readme.py``).
"""
from __future__ import annotations

import math
import os
import resource
import time
from pathlib import Path

IDLE_OTHERS_CORES = 0.5  # half a core of other work on average: beyond it a measurement on 2 cores is off


def _live_descendants_cpu() -> float:
    """CPU seconds of this process's live descendants (zombies included) and of the children each of them has
    reaped (``/proc/PID/stat`` utime + stime + cutime + cstime): a multiprocessing fork server that lives as long
    as this process reaps the ranks it forked, so their CPU reaches ``RUSAGE_CHILDREN`` only when it ends."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            rest = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parent[int(d)] = int(rest[1])
        cpu[int(d)] = sum(int(x) for x in rest[11:15]) / tick
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        total += cpu[pid]
        todo += children.get(pid, [])
    return total


def own_cpu_seconds() -> float:
    """CPU seconds of this process, its reaped descendants and its live ones (:func:`_live_descendants_cpu`)."""
    own = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = sum(r.ru_utime + r.ru_stime for r in own)
    try:
        mine += _live_descendants_cpu()
    except OSError:
        pass  # no /proc: the busy figure is nan anyway
    return mine


def cpu_seconds() -> tuple[float, float]:
    """(the machine's busy CPU seconds, user + nice + system of /proc/stat -- nan without /proc --, this process's
    and its descendants' CPU seconds, :func:`own_cpu_seconds`)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        busy = sum(int(x) for x in fields[1:4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = math.nan
    return busy, own_cpu_seconds()


class OthersCpu:
    """Started at construction; :meth:`cores` is the average number of cores other processes used since (nan
    where ``/proc/stat`` is missing); this process's descendants, live or reaped, are its own."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.busy0, self.mine0 = cpu_seconds()

    def wall_s(self) -> float:
        return time.perf_counter() - self.t0

    def cores(self) -> float:
        busy, mine = cpu_seconds()
        return max(0.0, (busy - self.busy0) - (mine - self.mine0)) / max(self.wall_s(), 1e-9)
