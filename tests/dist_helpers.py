"""Start N gloo ranks on CPU and fail the calling test on any rank's error.

Usage::

    def _body(rank, world_size, tmp):      # runs in every rank, process group already initialised
        ...assert things...

    def test_x(tmp_path):
        run_distributed(_body, 4, str(tmp_path))

The body must be a module-level function (it is pickled). Each rank's exception is sent back with its
traceback; a rank that dies without reporting (killed by a signal, ``os._exit``) is named with its exit code;
a hung collective raises after 3/4 of ``timeout`` and the whole run is killed after ``timeout`` s.

The ranks are forked from a multiprocessing fork server that imported torch and the library once per session
(``PRELOAD``), not spawned: a spawned rank spent 2-3 s of CPU importing torch and k3train before its first line,
which on 2 cores was most of the wall time of the suite's distributed tests. A rank is still a fresh process of
its own (its own gloo process group, memory, exit code) forked from an interpreter that only imported those
modules -- what a spawned rank holds after its imports -- and it gets the caller's environment as it is at the
call (a forked server's would be the one of its start), its working directory and ``sys.path``; what it prints
is shown on the caller's stdout once the ranks ended.
"""
from __future__ import annotations

import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 480.0
# imported once in the fork server (an import error there is ignored: the rank then imports it itself)
PRELOAD = ["torch", "torch.distributed", "k3train.trainer"]


def fork_context() -> Any:
    """The multiprocessing context whose processes fork from the session's fork server (``PRELOAD`` imported)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the session's first use)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, payload: bytes, q: Any, timeout: float,
            env: dict[str, str], log: str) -> None:
    os.environ.clear()  # the caller's environment at the call, not the fork server's
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # stdout and stderr: the caller shows them
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(payload)
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
        sys.stdout.flush()
        sys.stderr.flush()


def _show_output(logs: str, world_size: int) -> None:
    """What the ranks printed, on this process's stdout (pytest shows it with the test: the fork server's own
    stdout is the one of the test that started it)."""
    for r in range(world_size):
        path = os.path.join(logs, f"{r}.log")
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        if text:
            print(f"----- rank {r} stdout/stderr -----\n{text}", end="" if text.endswith("\n") else "\n")
    shutil.rmtree(logs, ignore_errors=True)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo ranks (processes forked from the fork server);
    fail on the first problem.

    ``timeout``: the whole run's deadline (the default leaves room for a loaded 2-core CI machine and still ends
    before pytest-timeout's 600 s, so the message below -- not a bare timeout -- is what a hang produces). Each
    collective may wait 3/4 of it, so a rank stuck in one raises (naming it) before the deadline. A failure names
    the rank and what happened to it: an exception (with its traceback), a rank that died without reporting (a
    signal, ``os._exit``, a segfault: its exit code), or ranks still running at the deadline."""
    ctx = fork_context()
    q = ctx.Queue()
    port = free_port()
    # the body and its arguments by value (plain pickle: tensors as bytes), not as torch.multiprocessing's shared
    # memory handles: the fork server passes at most 253 file descriptors per process, one per shared tensor
    payload = pickle.dumps((fn, args))
    logs = tempfile.mkdtemp(prefix="k3train-test-ranks-")
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, payload, q, 0.75 * timeout, dict(os.environ),
                                               f"{logs}/{r}.log"))
             for r in range(world_size)]
    for p in procs:
        p.start()
    reported: dict[int, str | None] = {}
    problems: list[str] = []
    deadline = time.monotonic() + timeout

    def drain(wait: float) -> None:
        try:
            rank, err = q.get(timeout=wait)
        except queue.Empty:
            return
        reported[rank] = err
        while True:
            try:
                rank, err = q.get_nowait()
            except queue.Empty:
                return
            reported[rank] = err

    try:
        while len(reported) < world_size and not problems:
            drain(0.5)
            if any(err is not None for err in reported.values()):
                break
            if any(p.exitcode is not None and r not in reported for r, p in enumerate(procs)):
                drain(0.5)  # a result put just before exiting may still be in the pipe
                if any(p.exitcode is not None and r not in reported for r, p in enumerate(procs)):
                    break
            elif time.monotonic() > deadline:
                waiting = [r for r in range(world_size) if r not in reported]
                problems.append(f"timed out after {timeout:g}s; ranks {waiting} still running (a hung collective?)")
    finally:
        killed: set[int] = set()
        for r, p in enumerate(procs):
            p.join(timeout=60 if len(reported) == world_size and not any(reported.values()) else 5)
            if p.is_alive():
                p.kill()
                p.join()
                killed.add(r)
        _show_output(logs, world_size)
    drain(0.1)  # errors put by ranks that failed while we were joining
    # the root cause first: a rank that died on its own (its peers' errors are consequences)
    problems = [f"rank {r} died without reporting: {_exit_status(p.exitcode)}" for r, p in enumerate(procs)
                if r not in reported and r not in killed] + problems
    errors = {r: e for r, e in reported.items() if e is not None}
    if problems or errors:
        lines = problems + [f"rank {r} raised:\n{errors[r]}" for r in sorted(errors)]
        others = [f"rank {r}: " + ("killed here after the failure" if r in killed else _exit_status(p.exitcode))
                  for r, p in enumerate(procs) if r not in errors and (r in reported or r in killed)]
        raise AssertionError("\n".join(lines + (["other ranks: " + ", ".join(others)] if others else [])))
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]
    if bad:
        raise AssertionError(f"rank {bad[0][0]} reported success but ended with {_exit_status(bad[0][1])}")
