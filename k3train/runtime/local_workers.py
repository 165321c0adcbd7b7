"""Local worker processes: N processes on this machine started as the ranks of one job, with torchrun's env://
variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), for the tests, the
benchmarks and other short multi-rank runs on one host.

* :func:`run_ranks`: ``fn(rank, world_size, *args)`` in every rank, a process group already initialised (gloo by
  default); returns what each rank returned, in rank order. A failure raises :class:`WorkerFailure` naming the
  rank and what happened to it: an exception (with its traceback), a rank that died without reporting (a signal,
  ``os._exit``, a segfault: its exit code), or ranks still running at the deadline. Every rank is ended before it
  returns or raises.
* :func:`run_module_ranks`: a module run as ``__main__`` in every rank (what ``torchrun -m`` runs, without the
  agent process): the first failing rank's exit code and the ranks' stdout and stderr.

The ranks are forked from a :mod:`multiprocessing` fork server that imported ``preload`` (torch, ...) once, not
spawned: a spawned rank spends 2-3 s of CPU importing torch before its first line. A rank is still a fresh
process of its own (its own process group, memory, exit code) and gets the caller's environment as it is at the
call (a fork server's own would be the one of its start), its working directory and ``sys.path``. What a rank of
:func:`run_ranks` prints is shown on the caller's stdout once the ranks ended.
"""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# what the fork server imports once (an import error there is ignored: a rank then imports the module itself)
DEFAULT_PRELOAD = ("torch", "torch.distributed")
# the variables that make a process a rank of a job (a child that is not one must not inherit them)
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
# torchrun's grace period between SIGTERM to the other workers of a failed one and SIGKILL
TERM_GRACE_S = 30.0


class WorkerFailure(RuntimeError):
    """A rank of :func:`run_ranks` failed; the message names each rank and what happened to it."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's env:// variables of ``rank`` of a one-host job whose rendezvous is ``127.0.0.1:port``."""
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))


def rank_free_environ() -> dict[str, str]:
    """This process's environment without the variables that make a process a rank (:data:`RANK_VARIABLES`)."""
    return {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}


def worker_context(preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD, start_method: str = "forkserver") -> Any:
    """The multiprocessing context of the ranks: ``forkserver`` (default), whose processes fork from this process's
    fork server (``preload`` imported; the list takes effect when the server starts: the first use in a process
    decides it); ``fork``, a copy of this process (what it imported too); ``spawn``, a fresh interpreter."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
    return ctx


def exit_status(code: int | None) -> str:
    """A process's exit code in words: ``exit code 7``, ``killed by SIGKILL (exit code -9)``, ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _redirect_output(out: str, err: str, mode: int) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) into the files ``out`` and ``err`` (``mode``:
    ``os.O_APPEND`` or ``os.O_TRUNC``)."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | mode)
        os.dup2(f, fd)
        os.close(f)


def _function_rank(rank: int, world_size: int, port: int, payload: bytes, q: Any, collective_timeout_s: float,
                   env: dict[str, str], log: str, backend: str, threads: int) -> None:
    """One rank of :func:`run_ranks`: report ``(rank, traceback or None, pickled return value)`` on ``q``."""
    os.environ.clear()  # the caller's environment at the call, not the fork server's
    os.environ.update(env)
    _redirect_output(log, log, os.O_APPEND)
    os.environ.update(rank_env(rank, world_size, port))
    torch.set_num_threads(threads)
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        result = fn(rank, world_size, *args)
        dist.barrier()
        q.put((rank, None, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()


class _Ranks:
    """The processes of one :func:`run_ranks` call and what they reported."""

    def __init__(self, procs: list[Any], q: Any, logs: str) -> None:
        self.procs, self.q, self.logs = procs, q, logs
        self.reported: dict[int, tuple[str | None, bytes | None]] = {}
        self.problems: list[str] = []
        self.killed: set[int] = set()

    def drain(self, wait: float) -> None:
        """Take every report on the queue, waiting up to ``wait`` s for the first."""
        try:
            rank, err, result = self.q.get(timeout=wait)
        except queue.Empty:
            return
        self.reported[rank] = (err, result)
        while True:
            try:
                rank, err, result = self.q.get_nowait()
            except queue.Empty:
                return
            self.reported[rank] = (err, result)

    def errors(self) -> dict[int, str]:
        return {r: err for r, (err, _) in self.reported.items() if err is not None}

    def silent_exit(self) -> bool:
        """A rank ended without reporting."""
        return any(p.exitcode is not None and r not in self.reported for r, p in enumerate(self.procs))

    def watch(self, timeout: float) -> None:
        """Wait until every rank reported, one failed, one died without reporting, or ``timeout`` s passed."""
        n = len(self.procs)
        deadline = time.monotonic() + timeout
        while len(self.reported) < n and not self.problems:
            self.drain(0.5)
            if self.errors():
                break
            if self.silent_exit():
                self.drain(0.5)  # a result put just before exiting may still be in the pipe
                if self.silent_exit():
                    break
            elif time.monotonic() > deadline:
                waiting = [r for r in range(n) if r not in self.reported]
                self.problems.append(f"timed out after {timeout:g}s; ranks {waiting} still running "
                                     "(a hung collective?)")

    def stop(self) -> None:
        """Join every rank (kill those still running after a grace period) and show what they printed."""
        clean = len(self.reported) == len(self.procs) and not self.errors()
        for r, p in enumerate(self.procs):
            p.join(timeout=60 if clean else 5)
            if p.is_alive():
                p.kill()
                p.join()
                self.killed.add(r)
        _show_output(self.logs, len(self.procs))

    def verdict(self) -> list[Any]:
        """Every rank's return value, or :class:`WorkerFailure` naming what went wrong (the root cause first: a
        rank that died on its own; its peers' errors are consequences)."""
        self.drain(0.1)  # errors put by ranks that failed while we were joining
        procs, errors = self.procs, self.errors()
        problems = [f"rank {r} died without reporting: {exit_status(p.exitcode)}" for r, p in enumerate(procs)
                    if r not in self.reported and r not in self.killed] + self.problems
        if problems or errors:
            lines = problems + [f"rank {r} raised:\n{errors[r]}" for r in sorted(errors)]
            others = [f"rank {r}: " + ("killed here after the failure" if r in self.killed
                                       else exit_status(p.exitcode))
                      for r, p in enumerate(procs) if r not in errors and (r in self.reported or r in self.killed)]
            raise WorkerFailure("\n".join(lines + (["other ranks: " + ", ".join(others)] if others else [])))
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]
        if bad:
            raise WorkerFailure(f"rank {bad[0][0]} reported success but ended with {exit_status(bad[0][1])}")
        return [pickle.loads(self.reported[r][1]) for r in range(len(procs))]


def _show_output(logs: str, world_size: int) -> None:
    """What the ranks printed, on this process's stdout (pytest shows it with the test: the fork server's own
    stdout is the one of the caller that started it)."""
    for r in range(world_size):
        path = os.path.join(logs, f"{r}.log")
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        if text:
            print(f"----- rank {r} stdout/stderr -----\n{text}", end="" if text.endswith("\n") else "\n")
    shutil.rmtree(logs, ignore_errors=True)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float, backend: str = "gloo", threads: int = 1,
              preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD, start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` ranks (processes forked from the fork server, a
    ``backend`` process group initialised, ``threads`` torch threads each); return each rank's return value, in
    rank order; raise :class:`WorkerFailure` on the first problem. ``start_method``: see :func:`worker_context`.

    ``fn`` must be a module-level function (it is pickled), its arguments and return values picklable.
    ``timeout``: the whole run's deadline; each collective may wait 3/4 of it, so a rank stuck in one raises
    (naming it) before the deadline."""
    ctx = worker_context(preload, start_method)
    q = ctx.Queue()
    port = free_port()
    # the body and its arguments by value (plain pickle: tensors as bytes), not as torch.multiprocessing's shared
    # memory handles: the fork server passes at most 253 file descriptors per process, one per shared tensor
    payload = pickle.dumps((fn, args))
    logs = tempfile.mkdtemp(prefix="k3train-ranks-")
    procs = [ctx.Process(target=_function_rank, args=(r, world_size, port, payload, q, 0.75 * timeout,
                                                      dict(os.environ), f"{logs}/{r}.log", backend, threads))
             for r in range(world_size)]
    for p in procs:
        p.start()
    ranks = _Ranks(procs, q, logs)
    try:
        ranks.watch(timeout)
    finally:
        ranks.stop()
    return ranks.verdict()


def _module_rank(module: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One process of :func:`run_module_ranks`: ``module`` run as ``__main__`` (what ``python -m`` runs) in its
    own session (torchrun starts each worker so), stdout and stderr into the files ``out`` and ``err``; it ends as
    the interpreter would: an uncaught exception's traceback and exit 1, ``sys.exit``'s code, non-daemon threads
    joined (``threading._shutdown``, as :mod:`multiprocessing` does), ``atexit`` functions run."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _redirect_output(out, err, os.O_TRUNC)
    sys.argv = [module, *argv]
    code: object = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, exit code 1
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # noqa: SLF001 - the interpreter's exit: wait for non-daemon threads, then atexit
    atexit._run_exitfuncs()  # noqa: SLF001
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _signal_session(p: Any, sig: int) -> None:
    """``sig`` to process ``p``'s session (what it started), or to ``p`` before it made one."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass


def _wait_like_torchrun(procs: list[Any], deadline: float, what: list[str], timeout: float) -> Any:
    """Wait for every process; as torchrun does, the first that fails has the others' sessions sent SIGTERM, then
    SIGKILL after :data:`TERM_GRACE_S`. Returns the first failed process (None); raises
    ``subprocess.TimeoutExpired`` at ``deadline``."""
    failed, grace_end = None, 0.0
    while alive := [p for p in procs if p.is_alive()]:  # one look: a rank may end between two
        if failed is None:
            failed = next((p for p in procs if p.exitcode not in (None, 0)), None)
            if failed is not None:  # torchrun stops the other workers of a failed one
                for p in procs:
                    if p.is_alive():
                        _signal_session(p, signal.SIGTERM)
                grace_end = time.monotonic() + TERM_GRACE_S
        elif time.monotonic() > grace_end:
            for p in procs:
                if p.is_alive():
                    _signal_session(p, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(what, timeout)
        alive[0].join(timeout=0.1)  # returns at once if it has ended since
    return failed


def run_module_ranks(module: str, argv: list[str], nproc: int, env: dict[str, str], cwd: str | Path,
                     timeout: float, preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD
                     ) -> subprocess.CompletedProcess:
    """``module`` run as ``__main__`` with ``argv`` and the environment ``env`` in one process (``nproc`` 0) or
    ``nproc`` ranks (torchrun's variables, :func:`rank_env`), each forked from the fork server into its own
    session. Returns the exit code (the first failing rank's, else 0; torchrun itself would exit 1 and print the
    worker's code) and the ranks' stdout and stderr, rank 0's first. At ``timeout`` every rank's session is killed
    and ``subprocess.TimeoutExpired`` raised. Variables that torch reads when it is imported (thread counts) cannot
    change in a forked rank: the fork server read them."""
    n = max(1, nproc)
    envs = [dict(env) for _ in range(n)]
    if nproc:
        port = free_port()
        for r, e in enumerate(envs):
            e.update(rank_env(r, n, port))
    logs = Path(tempfile.mkdtemp(prefix="k3train-module-ranks-"))
    ctx = worker_context(preload)
    procs = [ctx.Process(target=_module_rank, args=(module, argv, envs[r], str(cwd), str(logs / f"{r}.out"),
                                                    str(logs / f"{r}.err")))
             for r in range(n)]
    failed = None
    try:
        for p in procs:
            p.start()
        failed = _wait_like_torchrun(procs, time.monotonic() + timeout, [module, *argv], timeout)
    finally:
        for p in procs:
            if p.pid is not None:
                _signal_session(p, signal.SIGKILL)  # the session: whatever a rank started dies with it
                p.join()
        text = {name: "".join((logs / f"{r}.{name}").read_text(errors="replace")
                              for r in range(n) if (logs / f"{r}.{name}").is_file()) for name in ("out", "err")}
        shutil.rmtree(logs, ignore_errors=True)
    codes = [p.exitcode for p in procs]
    rc = failed.exitcode if failed is not None else next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess([module, *argv], rc, text["out"], text["err"])
