"""Preemption and Ctrl-C: every rank stops at the same step boundary, checkpoints that step, and the job exits with
one line.

Clusters preempt with SIGTERM (torchrun forwards it to its workers, then SIGKILLs them after its
``--shutdown-timeout``, 30 s by default); Ctrl-C sends SIGINT to the whole foreground process group (so each
torchrun worker gets it twice: from the terminal and forwarded). The handler only records the first signal: Python
runs it between bytecodes of the main thread, possibly in the middle of a pipeline schedule, where stopping would
leave the peers blocked in their next collective. At every step boundary each rank contributes its flag to ONE MAX
all-reduce over the world -- on every rank, every step, whatever the flag, so the sequence of collectives never
depends on which rank got the signal -- and all ranks learn the same answer after the same step.

Deadline: from the moment a rank learns of the stop (its own signal, or the agreement), it has
``checkpoint.preempt_timeout_s`` to finish the step and write its checkpoint. Past that, a watchdog thread prints
one line and exits the process (``os._exit``): better than the scheduler's SIGKILL in the middle of a line, and the
save is atomic (``CheckpointManager``), so the last complete checkpoint stays the one a re-run resumes.

Exit code after a stop: 128 + the signal number (143 for SIGTERM, 130 for SIGINT), with or without the
checkpoint -- the shell's convention for "ended by this signal". Not 0, because the run is not finished: a retry
loop or scheduler (Slurm ``--requeue``, ``until torchrun ...; do :; done``, a Kubernetes restart policy) must be
able to tell "done" (0) from "stopped early, resumable" (130/143) from "failed" (1) and "bad input" (2). Re-running
the same command resumes from the written checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code_for(signum: int) -> int:
    """128 + signal number: see the module docstring."""
    return 128 + int(signum)


class StopRun(Exception):
    """Raised by the training loop on every rank after an agreed stop and its checkpoint (``checkpoint``: the step
    directory's name). The entry point prints :meth:`line` on rank 0 and exits with :attr:`exit_code`."""

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        self.signum, self.step, self.checkpoint = int(signum), step, checkpoint
        super().__init__(self.line())

    @property
    def exit_code(self) -> int:
        return exit_code_for(self.signum)

    def line(self) -> str:
        return (f"k3train: stopped by {signal_name(self.signum)} at step {self.step}; "
                f"checkpoint {self.checkpoint} written (run the same command to resume)")


class StopSignals:
    """SIGTERM/SIGINT flag of one rank, its per-step agreement over the world, and the stop deadline.

    ``on_deadline()`` returns the line printed (on rank 0) when the deadline passes, e.g. naming the last
    complete checkpoint; it runs on the watchdog thread."""

    def __init__(self, rank: int, device: torch.device, deadline_s: float,
                 on_deadline: Callable[[int], str]) -> None:
        self.rank, self.device, self.deadline_s, self.on_deadline = rank, device, deadline_s, on_deadline
        self.received = 0  # the first signal this rank got (0: none)
        self.agreed = 0  # the signal all ranks agreed to stop for (0: none yet)
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._armed_for = 0

    # ------------------------------------------------------------------------------------------------------
    def install(self) -> "StopSignals":
        """Take over SIGTERM and SIGINT (main thread only: Python delivers signals there; elsewhere a no-op)."""
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers -- unless a stop was agreed: the process is then on its way out, and a
        second signal (torchrun forwarding the first, a repeated Ctrl-C) must not turn the clean exit into a kill."""
        if not self.agreed:
            for s, h in self._previous.items():
                signal.signal(s, h)
            self._previous.clear()
        self.disarm()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.received:
            self.received = signum
            self._arm(signum)

    # ------------------------------------------------------------------------------------------------------
    def agree(self) -> int:
        """The signal any rank received (MAX over the world: SIGTERM wins over SIGINT), 0 for none. Collective:
        every rank calls it once per step."""
        t = torch.tensor([self.received], dtype=torch.int64, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        sig = int(t.item())
        if sig:
            self.agreed = sig
            self._arm(sig)
        return sig

    def _arm(self, signum: int) -> None:
        if self._timer is None:
            self._armed_for = signum
            self._timer = threading.Timer(self.deadline_s, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        if self.rank == 0:
            try:
                msg = self.on_deadline(self._armed_for)
            except Exception as e:  # noqa: BLE001 - the exit below must happen whatever the message does
                msg = f"k3train: error: stop deadline passed ({e})"
            print(msg, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(exit_code_for(self._armed_for))
