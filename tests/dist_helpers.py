"""Spawn N gloo ranks on CPU and fail the calling test on any rank's error.

Usage::

    def _body(rank, world_size, tmp):      # runs in every rank, process group already initialised
        ...assert things...

    def test_x(tmp_path):
        run_distributed(_body, 4, str(tmp_path))

The body must be a module-level function (it is pickled). Each rank's exception is sent back with its
traceback; the first failing rank's message fails the test. A hung collective is killed after ``timeout`` s.
"""
from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, q: Any, timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        fn(rank, world_size, *args)
        dist.barrier()
        q.put((rank, None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, q, timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    errors: dict[int, str] = {}
    results = 0
    try:
        while results < world_size:
            rank, err = q.get(timeout=timeout + 60)
            results += 1
            if err is not None:
                errors[rank] = err
                break
    except Exception:  # queue timeout
        errors.setdefault(-1, f"timed out after {timeout + 60}s waiting for ranks")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad:
        raise AssertionError(f"a rank exited with code {bad[0]}")
