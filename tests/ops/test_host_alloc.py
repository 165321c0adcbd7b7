"""k3train/runtime/host_memory.py: after ``keep_freed_memory()`` a 16 MiB tensor comes from the process heap and freeing it
leaves the heap as large as it was (kept for the next allocation); glibc as it comes maps such a tensor from the
kernel, and hands it back on free. Each case runs in a fresh interpreter: the thresholds are process state.

Where the block lies is deterministic; page-fault counts are not (a freed block may be split by small allocations
in between), so the fault figures of benchmarks/bench_kda.py are measured there, not asserted here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
sys.path.insert(0, {root!r})
import torch
from k3train.runtime.host_memory import keep_freed_memory
if {keep}:
    print(keep_freed_memory(), file=sys.stderr)

def heap():
    for line in open("/proc/self/maps"):
        if "[heap]" in line:
            return [int(v, 16) for v in line.split()[0].split("-")]
    return [0, 0]

x = torch.empty(4 * 2**20).fill_(1.0)            # 16 MiB of fp32
lo, hi = heap()
in_heap = lo <= x.data_ptr() < hi
del x
lo2, hi2 = heap()
print(int(in_heap), hi - lo, hi2 - lo2)
"""


def _probe(keep: bool) -> tuple[bool, int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(root=str(ROOT), keep=keep)], capture_output=True,
                         text=True, timeout=120, check=True)
    in_heap, size, size_after = out.stdout.split()
    return bool(int(in_heap)), int(size), int(size_after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt, /proc/self/maps")
def test_keep_freed_memory_serves_large_tensors_from_the_kept_heap() -> None:
    in_heap, size, size_after = _probe(True)
    assert in_heap, "with keep_freed_memory a 16 MiB tensor was not served from the heap (mmap threshold not set)"
    assert size_after >= size, f"freeing it shrank the heap from {size} to {size_after} bytes (trim threshold not set)"
    in_heap, _, _ = _probe(False)
    assert not in_heap, ("glibc's default served a fresh 16 MiB tensor from the heap: the probe no longer shows what "
                         "keep_freed_memory changes")
