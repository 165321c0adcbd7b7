"""The trainer anchor's runs, each in a fresh process (:mod:`k3train.planning.calibration.anchor_run` is what
they run): the real trainer beside the isolated layer timing, and its concurrency curve."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from k3train.planning.calibration.host import child_env

CONCURRENCY_ROUNDS = 5  # each phase is a few seconds of a drifting host: the median of 5 rounds' ratios


def _run_module(args: list[str], threads: int, what: str, timeout: float) -> Any:
    """Run :mod:`.anchor_run` in a fresh process (``threads`` intra-op threads, no torchrun variables) with ``args``
    and ``--out FILE``; return the JSON it wrote."""
    root = Path(__file__).resolve().parents[3]
    with tempfile.TemporaryDirectory(prefix="k3anchor_") as tmp:
        env = child_env(root, str(threads))
        cmd = [sys.executable, "-m", "k3train.planning.calibration.anchor_run", "--out", f"{tmp}/out.json",
               f"--threads={threads}", *args]
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
        return json.loads(Path(f"{tmp}/out.json").read_text())


def run_anchor(config: str, overrides: list[str], threads: int, timeout: float = 1800) -> dict[str, Any]:
    """Run :func:`.anchor_run.main` in a fresh one-process job (``threads`` intra-op threads) and return its file."""
    return _run_module(["--config", config, *overrides], threads, "trainer anchor run", timeout)


def run_concurrency(config: str, overrides: list[str], procs: int, threads: int,
                    timeout: float = 1800) -> dict[str, float]:
    """:func:`.anchor_run.concurrency_curve` in a fresh job: ``{n: speed}`` of the one-process trainer of
    ``overrides`` while ``n`` copies of it step at once."""
    return _run_module(["--concurrency", str(procs), f"--rounds={CONCURRENCY_ROUNDS}", "--config", config,
                        *overrides], threads, "trainer concurrency calibration", timeout)
