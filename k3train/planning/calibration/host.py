"""This host, as a calibration is keyed by it (processor, cores, torch, threads), and the calibration file."""
from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import torch

from k3train.runtime.cache_dir import cache_dir
from k3train.runtime.process_groups import child_pythonpath, cores_available


def cache_path(explicit: str | None = None) -> Path:
    if explicit:
        return Path(explicit)
    return cache_dir() / "cpu_calibration.json"


# instruction-set extensions that change what a CPU kernel (and so every timing) does
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu_model() -> str:
    """The processor's model name and its vector extensions (``/proc/cpuinfo``; the platform's name elsewhere)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k == "model name" and v.strip():
                name = v.strip()
            elif k in ("flags", "Features"):
                flags |= set(v.split())
    except OSError:
        pass
    return f"{name} [{' '.join(f for f in _ISA_FLAGS if f in flags) or '-'}]"


def host_key(threads: int) -> str:
    """What a cpu calibration holds for: the host, the cores this process may use, the processor and its vector
    extensions, the torch version and the intra-op threads per rank. A run under other conditions (another
    machine behind the same host name, another torch, other threads) finds no entry and measures anew."""
    return (f"{socket.gethostname()}|cores={cores_available()}|cpu={cpu_model()}|torch={torch.__version__}"
            f"|threads={threads}")


def load_cache(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_cache(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def median_time(fn, reps: int) -> float:  # noqa: ANN001
    """Median wall time of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def child_env(root: Path, threads: str) -> dict[str, str]:
    """The environment of a job this host runs to measure (a trainer run, a torchrun): this process's without a
    launcher's rank variables, wandb off, ``threads`` intra-op threads, the checkout ``root`` first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS=threads, PYTHONPATH=child_pythonpath(root))
    return env
