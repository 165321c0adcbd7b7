"""Microbenchmarks of this host: matmul, copy, gloo between local processes, ranks computing at once, small
collectives among busy ranks."""
from __future__ import annotations

import json
import multiprocessing
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from k3train.planning.calibration.host import median_time


def bench_matmul(threads: int, n: int = 512) -> float:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = median_time(lambda: a @ b, 7)
    torch.set_num_threads(old)
    return 2 * n ** 3 / t


def bench_copy(nbytes: int = 64 * 2**20) -> float:
    x = torch.empty(nbytes // 4)
    y = torch.empty_like(x)
    t = median_time(lambda: y.copy_(x), 5)
    return 2 * nbytes / t  # read + write


def _gloo_worker(rank: int, port: int, out: str) -> None:
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "gloo.json")
        torch_mp.start_processes(_gloo_worker, args=(port, out), nprocs=2, join=True, start_method="spawn")
        r = json.loads(Path(out).read_text())
    big = 4 * 2**20
    p2p_bw = big / max(1e-9, r["p2p_big"] - r["p2p_small"])
    # a 2-rank ring all-reduce moves 2 (n-1)/n = 1 x the bytes over 2 (n-1) = 2 latency steps
    ar_lat = r["ar_small"] / 2
    ar_bw = big / max(1e-9, r["ar_big"] - r["ar_small"])
    return {"p2p_latency_s": r["p2p_small"], "p2p_bw": p2p_bw, "coll_latency_s": ar_lat, "coll_bw": ar_bw}


def _busy_worker(idx: int, threads: int, barrier: Any, out: Any) -> None:
    """One of ``n`` processes of :func:`bench_concurrency`: the same workload, started together."""
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
    ctx = multiprocessing.get_context("forkserver")
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
