"""Keep freed host memory in the process (glibc), for CPU benchmarks of ops that allocate large temporaries.

glibc's malloc hands blocks above its mmap threshold (dynamic, starting at 128 KiB) straight back to the kernel
on ``free`` and trims the heap top above its trim threshold, so a CPU op whose temporaries are tens of MiB pays
the kernel's zero-filling of every page again on every call: benchmarks/bench_kda.py at T=4096, H=4, K=V=128 took
50,000-60,000 minor page faults and 90-170 ms of system time per forward + backward (a fifth of the op) until an
earlier, larger op happened to raise both thresholds. torch's CUDA caching allocator never returns memory
between steps, so on the device the op pays none of this; benchmarks that time an op's own work call
:func:`keep_freed_memory` first. Training does not: with the same thresholds, configs/small.yaml's step time (one
process, 2 threads) did not change measurably (14.4-15.7 s against 13.8-15.4 s).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX_BYTES = 32 * 2**20       # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit hosts
_TRIM_BYTES = 2**31 - 1          # the largest value mallopt's int takes (2 GiB)


def keep_freed_memory() -> str:
    """Fix glibc's mmap threshold at 32 MiB and its trim threshold at 2 GiB for this process; returns what was done (a
    line for the benchmark's header). A no-op off Linux / glibc."""
    if not sys.platform.startswith("linux"):
        return "host allocator unchanged (not Linux)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "host allocator unchanged (no glibc mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = [mallopt(option, value) == 1 for option, value in ((_M_MMAP_THRESHOLD, _MMAP_MAX_BYTES),
                                                              (_M_TRIM_THRESHOLD, _TRIM_BYTES))]
    if not all(done):
        return "host allocator not (fully) changed: mallopt refused"
    return ("host allocator keeps freed memory (glibc mmap threshold 32 MiB, heap trimmed above 2 GiB free), as a "
            "device caching allocator does")
