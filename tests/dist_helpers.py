"""Start N gloo ranks on CPU and fail the calling test on any rank's error.

Usage::

    def _body(rank, world_size, tmp):      # runs in every rank, process group already initialised
        ...assert things...

    def test_x(tmp_path):
        run_distributed(_body, 4, str(tmp_path))

The body must be a module-level function (it is pickled). The ranks are started by the shared launcher
(k3train/runtime/local_workers.py: forked from a fork server that imported torch and the library once per session,
``PRELOAD``; what they print is shown on the caller's stdout once they ended); a failure is this test's
``AssertionError`` with the launcher's account of it: each rank's exception with its traceback, a rank that died
without reporting (killed by a signal, ``os._exit``) with its exit code, or a hung collective (it raises after 3/4
of ``timeout``; the whole run is killed after ``timeout`` s).
"""
from __future__ import annotations

from typing import Any, Callable

from k3train.runtime.local_workers import WorkerFailure, run_ranks

DEFAULT_TIMEOUT_S = 480.0
# imported once in the fork server (an import error there is ignored: the rank then imports it itself)
PRELOAD = ("torch", "torch.distributed", "k3train.trainer")


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                    start_method: str = "forkserver") -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo ranks; fail on the first problem.

    ``timeout``: the whole run's deadline (the default leaves room for a loaded 2-core CI machine and still ends
    before pytest-timeout's 600 s, so the launcher's message -- not a bare timeout -- is what a hang produces).
    ``start_method="fork"``: the ranks are copies of the test process (what it imported, e.g. megatron's dataset
    builder, which the fork server did not)."""
    try:
        run_ranks(fn, world_size, *args, timeout=timeout, preload=PRELOAD, start_method=start_method)
    except WorkerFailure as e:
        raise AssertionError(str(e)) from None
