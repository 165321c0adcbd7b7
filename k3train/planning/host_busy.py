"""How much of the machine other processes took while this one measured.

A timing is only as good as the machine was idle while it was taken: on a 2-core host one other busy process
makes every per-layer time, the concurrency curve and the trainer anchor slower by up to 2x, and a calibration
taken so predicts every layout too slow from then on (it is cached). :class:`OthersCpu` measures it directly: the
machine's busy CPU time (``/proc/stat``) less this process's and its waited-for descendants' own
(``getrusage``), over the wall time -- the cores that something else used. The planner keeps a calibration only
when that stayed under :data:`IDLE_OTHERS_CORES` (``tools/plan.py``), marks each ``--measure`` run by it, and
``make bench`` refuses a run above it (``tools/bench_readme.py``).
"""
from __future__ import annotations

import math
import os
import resource
import time
from pathlib import Path

IDLE_OTHERS_CORES = 0.5  # half a core of other work on average: beyond it a measurement on 2 cores is off


def cpu_seconds() -> tuple[float, float]:
    """(the machine's busy CPU seconds, user + nice + system of /proc/stat -- nan without /proc --, this process's
    and its reaped descendants' CPU seconds)."""
    own = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = sum(r.ru_utime + r.ru_stime for r in own)
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        busy = sum(int(x) for x in fields[1:4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = math.nan
    return busy, mine


class OthersCpu:
    """Started at construction; :meth:`cores` is the average number of cores other processes used since (nan
    where ``/proc/stat`` is missing). Children count as this process's own once they have been waited for."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.busy0, self.mine0 = cpu_seconds()

    def wall_s(self) -> float:
        return time.perf_counter() - self.t0

    def cores(self) -> float:
        busy, mine = cpu_seconds()
        return max(0.0, (busy - self.busy0) - (mine - self.mine0)) / max(self.wall_s(), 1e-9)
