"""Device table of the planner: published GPU figures, and ``cpu`` calibrated by microbenchmarks on this machine.

GPUs (per GPU; published dense figures, K3-SPEC "Facts for the planning tools"): bf16 dense peak FLOP/s, HBM
bytes and bandwidth, NVLink bandwidth (the published figure is bidirectional: one direction, 450 GB/s on Hopper,
is what a ring step moves), the scale-out NIC per GPU (400 Gb/s = 50 GB/s), 8 GPUs per node. Stated achievable
efficiencies (fractions of those peaks that the planner assumes): ``compute_eff`` 0.55 of the bf16 peak for
model matmuls (large-GEMM throughput; the end-to-end MFU the plan reports is lower: bubble, communication and
optimizer come on top), ``link_eff`` 0.8 of the link bandwidth for collectives and p2p, ``hbm_eff`` 0.8 for
memory-bound updates (AdamW, Muon's elementwise part). No overlap of communication with compute is assumed: the
runtime issues every EP all-to-all in line, so the planner charges all of it (what is hidden must come from a
schedule the runtime executes, not a factor). Every field is overridable
(``--device-field peak_flops=1.2e15``).

``cpu``: one torchrun rank per process on this host; everything is measured once and cached in a JSON file
(``~/.cache/k3train/cpu_calibration.json`` or ``--calibration FILE``), keyed by host, cores and torch version:
matmul FLOP/s at the thread count a rank gets, copy bandwidth, gloo point-to-point and all-reduce latency and
bandwidth between two local processes, what a small all-reduce over the world's ranks costs while every rank
computes between collectives (``loaded_collective_s`` per kind: what the planner charges per call on this host;
it includes waiting for a busy or descheduled peer), and how fast a rank computes while ``n`` ranks compute at once
(``concurrency``: :meth:`Device.rank_speed`). Per-layer and per-parameter times of a config are measured separately
(:mod:`k3train.planning.layer_bench`), since framework overhead, not FLOPs, dominates CPU-sized models.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from k3train.config import ConfigError

GB = 1e9


@dataclass
class Device:
    name: str
    peak_flops: float          # bf16 dense FLOP/s per device (cpu: measured fp32 matmul at the rank's threads)
    hbm_bytes: float           # device memory (cpu: host RAM / ranks on the host)
    hbm_bw: float              # bytes/s
    nvlink_bw: float           # bytes/s one direction, inside a node (cpu: gloo between local processes)
    internode_bw: float        # bytes/s one direction per device across nodes
    gpus_per_node: int = 8
    lat_intra: float = 5e-6    # seconds per message / ring step inside a node
    lat_inter: float = 12e-6   # across nodes
    call_lat: dict[str, float] = field(default_factory=dict)  # per collective kind: seconds per call on top of its
    #                             ring steps (cpu: waiting for busy peers, devices.bench_loaded_collective; GPUs: none)
    compute_eff: float = 0.55
    link_eff: float = 0.8
    hbm_eff: float = 0.8
    cores: int = 0             # cpu: cores shared by the ranks of the host (0 = no sharing: a GPU each)
    threads: int = 1           # cpu: intra-op threads per rank
    calibration: dict[str, Any] = field(default_factory=dict)

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    def flops(self) -> float:
        return self.peak_flops * self.compute_eff

    @property
    def shares_cores(self) -> bool:
        """cpu: the ranks of the host compete for its cores (a GPU each otherwise)."""
        return self.is_cpu and self.cores > 0

    def rank_speed(self, busy: int) -> float:
        """A rank's compute speed (1 = alone on the host) while ``busy`` ranks compute at once. cpu: the
        calibrated curve ``calibration['concurrency'][n]`` (``bench_concurrency``), extended past its last point
        by processor sharing; plain ``min(1, cores / (threads x busy))`` without one. GPUs: 1."""
        if not self.shares_cores:
            return 1.0
        n = max(1, busy) * self.threads
        curve = {int(k): float(v) for k, v in self.calibration.get("concurrency", {}).items()}
        if not curve:
            return min(1.0, self.cores / n)
        top = max(curve)
        return curve[n] if n <= top else curve[top] * top / n  # measured for 1..top processes

    def call_cost(self, kind: str) -> float:
        """Seconds one collective call of ``kind`` costs beyond its ring steps (``call_lat``; the all-to-all's for
        p2p batches, which synchronise the same way)."""
        return self.call_lat.get(kind, self.call_lat.get("all_to_all", 0.0) if kind == "p2p" else 0.0)

    def link(self, intra: bool) -> tuple[float, float]:
        """``(latency s, bandwidth bytes/s)`` of a link inside (``intra``) or across nodes."""
        if intra:
            return self.lat_intra, self.nvlink_bw * self.link_eff
        return self.lat_inter, self.internode_bw * self.link_eff

    def describe(self) -> str:
        s = (f"device {self.name}: {self.peak_flops / 1e12:.3g} TFLOP/s x {self.compute_eff:.2f} achievable, "
             f"{self.hbm_bytes / 2**30:.1f} GiB at {self.hbm_bw / GB:.3g} GB/s, intra-node {self.nvlink_bw / GB:.3g} "
             f"GB/s, inter-node {self.internode_bw / GB:.3g} GB/s (x {self.link_eff:.2f}), "
             f"{self.gpus_per_node} per node")
        if self.is_cpu:
            s += f", {self.cores} cores, {self.threads} thread(s)/rank; calibration {self.calibration.get('path', '')}"
            taken = self.calibration.get("taken")
            if taken:
                s += (f"\n  calibrated {taken['time']} under {taken['key']}, 1-minute load average then "
                      f"{taken['load1']:.2f}" + (" (over 0.5: if other work was running then, its timings and so every "
                                                 "prediction are off: delete the file and plan again on an idle "
                                                 "machine)" if taken["load1"] > 0.5 else ""))
        return s


PUBLISHED = {
    "h100": Device("h100", peak_flops=989e12, hbm_bytes=80 * GB, hbm_bw=3.35e12, nvlink_bw=450 * GB,
                   internode_bw=50 * GB),
    "h200": Device("h200", peak_flops=989e12, hbm_bytes=141 * GB, hbm_bw=4.8e12, nvlink_bw=450 * GB,
                   internode_bw=50 * GB),
    "b200": Device("b200", peak_flops=2250e12, hbm_bytes=180 * GB, hbm_bw=8e12, nvlink_bw=900 * GB,
                   internode_bw=100 * GB),
}
DEVICE_NAMES = ("cpu", *PUBLISHED)

# torch.cuda.get_device_name -> published dense bf16 peak per GPU (the MFU denominator on CUDA, k3train/reporting/metrics.py).
# First match of a lower-case substring wins, so the PCIe / NVL H100 parts (lower clocks) come before plain "h100"
# (SXM: "NVIDIA H100 80GB HBM3").
CUDA_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", PUBLISHED["h100"].peak_flops),
    ("h200", PUBLISHED["h200"].peak_flops),
    ("b200", PUBLISHED["b200"].peak_flops),
)


def published_bf16_peak(device_name: str) -> tuple[str, float] | None:
    """``(matched part, dense bf16 FLOP/s)`` for a CUDA device name such as ``"NVIDIA H200"``, else None."""
    low = device_name.lower()
    for part, flops in CUDA_BF16_PEAKS:
        if part in low:
            return part, flops
    return None


def apply_fields(dev: Device, items: list[str]) -> Device:
    """``["peak_flops=1e15", ...]`` -> a copy with those fields set (ConfigError naming a bad one)."""
    kinds = {f.name: f.type for f in fields(Device) if f.name not in ("name", "calibration", "call_lat")}
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or k not in kinds:
            raise ConfigError(f"--device-field {it!r}: expected FIELD=VALUE with FIELD one of {', '.join(kinds)}")
        try:
            out[k] = int(float(v)) if kinds[k] in ("int", int) else float(v)
        except ValueError:
            raise ConfigError(f"--device-field {it!r}: {v!r} is not a number") from None
        if out[k] < 0 or (k in ("peak_flops", "hbm_bytes", "hbm_bw", "nvlink_bw", "internode_bw") and out[k] == 0):
            raise ConfigError(f"--device-field {it!r}: must be positive")
    return replace(dev, **out)


# --------------------------------------------------------------------------------------------------------------
# cpu calibration
# --------------------------------------------------------------------------------------------------------------
def cache_path(explicit: str | None = None) -> Path:
    if explicit:
        return Path(explicit)
    from k3train.runtime.cache_dir import cache_dir

    return cache_dir() / "cpu_calibration.json"


# instruction-set extensions that change what a CPU kernel (and so every timing) does
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu_model() -> str:
    """The processor's model name and its vector extensions (``/proc/cpuinfo``; the platform's name elsewhere)."""
    import platform

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
    import torch

    return (f"{socket.gethostname()}|cores={cores_available()}|cpu={cpu_model()}|torch={torch.__version__}"
            f"|threads={threads}")


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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


def bench_matmul(threads: int, n: int = 512) -> float:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = median_time(lambda: a @ b, 7)
    torch.set_num_threads(old)
    return 2 * n ** 3 / t


def bench_copy(nbytes: int = 64 * 2**20) -> float:
    import torch

    x = torch.empty(nbytes // 4)
    y = torch.empty_like(x)
    t = median_time(lambda: y.copy_(x), 5)
    return 2 * nbytes / t  # read + write


def _gloo_worker(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for name, n in (("small", 256), ("big", 4 * 2**20)):
        x = torch.zeros(n // 4)
        reps = 30 if name == "small" else 6
        # ping-pong: one-way time = half a round trip
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
        res[f"p2p_{name}"] = (time.perf_counter() - t0) / reps / 2
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        res[f"ar_{name}"] = (time.perf_counter() - t0) / reps
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def bench_gloo() -> dict[str, float]:
    """Latency and bandwidth of gloo p2p and all-reduce between two local processes."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "gloo.json")
        mp.start_processes(_gloo_worker, args=(port, out), nprocs=2, join=True, start_method="spawn")
        r = json.loads(Path(out).read_text())
    big = 4 * 2**20
    p2p_bw = big / max(1e-9, r["p2p_big"] - r["p2p_small"])
    # a 2-rank ring all-reduce moves 2 (n-1)/n = 1 x the bytes over 2 (n-1) = 2 latency steps
    ar_lat = r["ar_small"] / 2
    ar_bw = big / max(1e-9, r["ar_big"] - r["ar_small"])
    return {"p2p_latency_s": r["p2p_small"], "p2p_bw": p2p_bw, "coll_latency_s": ar_lat, "coll_bw": ar_bw}


def _busy_worker(idx: int, threads: int, barrier: Any, out: Any) -> None:
    """One of ``n`` processes of :func:`bench_concurrency`: the same workload, started together."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(idx)
    x = torch.randn(256, 128, generator=g)
    w1 = torch.randn(128, 384, generator=g, requires_grad=True)
    w2 = torch.randn(384, 128, generator=g, requires_grad=True)

    def work() -> None:
        # the op mix of a CPU-sized layer: small matmuls, elementwise, a reduction, autograd
        for _ in range(12):
            h = torch.nn.functional.gelu(x @ w1)
            y = torch.softmax(h @ w2, dim=-1) * x
            y.square().mean().backward()
            w1.grad = w2.grad = None

    work()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(6):
        work()
    out[idx] = time.perf_counter() - t0


def _forkserver() -> Any:
    """Worker processes forked from a server that imported torch once: each starts in milliseconds, not an
    import's seconds."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def _run_workers(ctx: Any, target: Any, arg_lists: list[tuple], what: str) -> None:
    """Start one process per argument tuple, wait for all; a failed worker is an error naming ``what``."""
    procs = [ctx.Process(target=target, args=a) for a in arg_lists]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{what}: a worker failed")


def bench_concurrency(max_procs: int, threads: int, target: Any = None, args: tuple = ()) -> dict[str, float]:
    """``{n: speed}`` for ``n = 1..max_procs``: the slowest process's speed (a synchronous step waits for it),
    relative to one process alone, of ``n`` processes running the same workload at once (made monotone: more ranks
    never run faster). The workload:
    ``target(idx, threads, barrier, out, *args)`` (warm up, ``barrier.wait()``, then ``out[idx] = seconds``);
    default: a small-op mix (:func:`_busy_worker`)."""
    ctx = _forkserver()
    times: dict[int, float] = {}
    for n in range(1, max_procs + 1):
        barrier, out = ctx.Barrier(n), ctx.Array("d", n)
        _run_workers(ctx, target or _busy_worker, [(i, threads, barrier, out, *args) for i in range(n)],
                     f"cpu concurrency calibration ({n} processes)")
        times[n] = max(out[:])
    curve, best = {}, 1.0
    for n in range(1, max_procs + 1):
        best = min(best, times[1] / times[n])
        curve[str(n)] = best
    return curve


LOADED_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _loaded_gloo_worker(rank: int, n: int, port: int, threads: int, out: Any) -> None:
    """One of ``n`` ranks of :func:`bench_loaded_collective`: a compute slice then one small collective, looped,
    for each collective kind the step uses (the calls the project makes: ``all_gather_single`` /
    ``reduce_scatter_single`` when torch has them, ``all_to_all_single`` with split sizes)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    g = torch.Generator().manual_seed(rank)
    x, w = torch.randn(64, 128, generator=g), torch.randn(128, 128, generator=g)
    small, full = torch.zeros(64), torch.zeros(64 * n)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    splits = [64] * n
    ops = {"all_reduce": lambda: dist.all_reduce(small), "all_gather": lambda: gather(full, small),
           "reduce_scatter": lambda: scatter(small, full),
           "all_to_all": lambda: dist.all_to_all_single(full, full.clone(), splits, splits)}

    def compute() -> None:
        for _ in range(4):
            torch.tanh(x @ w).sum()

    def loop(op: Any, reps: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            compute()
            if op is not None:
                op()
        dist.barrier()
        return (time.perf_counter() - t0) / reps

    for op in ops.values():
        loop(op, 10)
    base = min(loop(None, 150) for _ in range(3))
    for i, kind in enumerate(LOADED_KINDS):
        out[rank * len(LOADED_KINDS) + i] = max(0.0, min(loop(ops[kind], 150) for _ in range(3)) - base)
    dist.destroy_process_group()


def bench_loaded_collective(n: int, threads: int) -> dict[str, float]:
    """Per collective kind (:data:`LOADED_KINDS`), the seconds one small call over ``n`` ranks of this host adds
    to a rank that computes between collectives (every rank busy, as in a training step): idle ping-pong latency
    misses the wait for a busy or descheduled peer. Median over ranks."""
    if n < 2:
        return {k: 0.0 for k in LOADED_KINDS}
    ctx = _forkserver()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Array("d", n * len(LOADED_KINDS))
    _run_workers(ctx, _loaded_gloo_worker, [(r, n, port, threads, out) for r in range(n)],
                 f"cpu calibration of loaded collectives ({n} processes)")
    res = {}
    for i, kind in enumerate(LOADED_KINDS):
        ts = sorted(out[r * len(LOADED_KINDS) + i] for r in range(n))
        res[kind] = ts[len(ts) // 2]
    return res


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


def get_device(name: str, world_size: int, field_items: list[str], calibration: str | None = None,
               log: Any = print) -> Device:
    name = name.lower()
    if name not in DEVICE_NAMES:
        raise ConfigError(f"--device {name!r}: expected one of {', '.join(DEVICE_NAMES)}")
    apply_fields(PUBLISHED["h100"], field_items)  # bad fields are reported before any calibration
    dev = calibrate_cpu(world_size, cache_path(calibration), log) if name == "cpu" else PUBLISHED[name]
    return apply_fields(dev, field_items)


def device_json(dev: Device) -> dict[str, Any]:
    return asdict(dev)
