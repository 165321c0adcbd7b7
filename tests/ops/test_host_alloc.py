"""k3train/host_alloc.py: after ``keep_freed_memory()`` a freed 16 MiB tensor's pages are reused by the next one
(no page faults); glibc as it comes faults the second allocation in again. Each case runs in a fresh interpreter:
the allocator's thresholds are process state that other tests move."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import resource, sys
sys.path.insert(0, {root!r})
import torch
from k3train.host_alloc import keep_freed_memory
if {keep}:
    print(keep_freed_memory(), file=sys.stderr)
n = 4 * 2**20                                    # 16 MiB of fp32
torch.empty(n).fill_(1.0)                        # first: allocated, touched, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(n).fill_(2.0)                        # second: the freed pages again, or fresh ones from the kernel
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: bool) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(root=str(ROOT), keep=keep)], capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keep_freed_memory_reuses_pages() -> None:
    pages = 16 * 2**20 // 4096
    kept, default = _faults(True), _faults(False)
    assert kept < pages // 8, f"with keep_freed_memory the second 16 MiB tensor faulted {kept} pages in"
    assert default > pages // 2, (f"glibc's default faulted only {default} pages for the second 16 MiB tensor: the "
                                  f"probe no longer shows what keep_freed_memory changes")
