"""The ``cpu`` device of this host: one torchrun rank per process on this host; everything is measured once and
cached in a JSON file (``~/.cache/k3train/cpu_calibration.json`` or ``--calibration FILE``), keyed by host, cores and
torch version:
matmul FLOP/s at the thread count a rank gets, copy bandwidth, gloo point-to-point and all-reduce latency and
bandwidth between two local processes, what a small all-reduce over the world's ranks costs while every rank
computes between collectives (``loaded_collective_s`` per kind: what the planner charges per call on this host;
it includes waiting for a busy or descheduled peer), and how fast a rank computes while ``n`` ranks compute at once
(``concurrency``: :meth:`Device.rank_speed`). Per-layer and per-parameter times of a config are measured separately
(:mod:`k3train.planning.calibration.layer_bench`), since framework overhead, not FLOPs, dominates CPU-sized models.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from k3train.planning.calibration.cpu_bench import (bench_concurrency, bench_copy, bench_gloo, bench_loaded_collective,
                                                    bench_matmul)
from k3train.planning.calibration.host import host_key, load_cache, save_cache
from k3train.planning.step_time.device import Device
from k3train.runtime.process_groups import cores_available


def calibrate_cpu(world_size: int, path: Path, log: Any = print) -> Device:
    """The ``cpu`` device for ``world_size`` ranks on this host (measured once per host and thread count)."""
    cores = cores_available()
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    threads = int(env) if env.isdigit() and int(env) > 0 else max(1, cores // max(1, world_size))
    data = load_cache(path)
    key = host_key(threads)
    cal = data.get(key, {}).get("machine")
    if cal is None:
        log(f"calibrating cpu (matmul, copy, gloo between 2 processes; cached in {path}) ...")
        taken = {"time": time.strftime("%Y-%m-%d %H:%M"), "key": key, "load1": os.getloadavg()[0]}
        cal = {"matmul_flops": bench_matmul(threads), "copy_bw": bench_copy(), **bench_gloo(), "taken": taken}
        data.setdefault(key, {})["machine"] = cal
        save_cache(path, data)
    # ranks competing for the cores: measured up to this many processes (2 to 4 x the cores; processor sharing
    # extends the curve past that)
    procs = max(1, min(max(world_size, 2 * cores), 4 * cores) // threads)
    if len(cal.get("concurrency", {})) < procs:
        log(f"calibrating cpu concurrency: 1..{procs} processes at once ...")
        cal["concurrency"] = bench_concurrency(procs, threads)
        data = load_cache(path)
        data.setdefault(key, {})["machine"] = cal
        save_cache(path, data)
    loaded = cal.setdefault("loaded_collective_s", {})
    if world_size > 1 and str(world_size) not in loaded:
        log(f"calibrating cpu: small collectives over {world_size} busy processes ...")
        loaded[str(world_size)] = bench_loaded_collective(world_size, threads)
        data = load_cache(path)
        data.setdefault(key, {})["machine"] = cal
        save_cache(path, data)
    # what a call costs beyond the idle ring steps ring_time charges it ((n-1) p2p latencies; an all-reduce 2 x)
    steps = {"all_reduce": 2 * max(0, world_size - 1)}
    call_lat = {k: max(0.0, v - steps.get(k, max(0, world_size - 1)) * cal["p2p_latency_s"])
                for k, v in loaded.get(str(world_size), {}).items()}
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * 2**30
    return Device("cpu", peak_flops=cal["matmul_flops"], hbm_bytes=ram / max(1, world_size), hbm_bw=cal["copy_bw"],
                  nvlink_bw=cal["p2p_bw"], internode_bw=cal["p2p_bw"], gpus_per_node=max(1, world_size),
                  lat_intra=cal["p2p_latency_s"], lat_inter=cal["p2p_latency_s"], call_lat=call_lat, compute_eff=1.0,
                  link_eff=1.0, hbm_eff=1.0, cores=cores, threads=threads,
                  calibration={**cal, "path": str(path), "key": key})
