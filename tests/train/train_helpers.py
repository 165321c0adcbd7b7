"""Helpers of the end-to-end trainer tests: run the real entry point, read metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dist_helpers import PRELOAD
from k3train.runtime.local_workers import rank_free_environ, run_module_ranks
from k3train.runtime.process_groups import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# a short run of the tiny config: 64-token sequences, 4 per step in 2 micro-batches per rank-pair
FAST = ["--train.seq_len=64", "--train.global_batch_size=4", "--train.micro_batch_size=1",
        "--data.split=100,0,0", "--logging.wandb=false", "--optim.warmup_steps=2"]
# steps of the shared single-process reference run (the `straight` fixture of tests/train/conftest.py): a resumed run
# stops at 2 and resumes; step 3's update is the first with the loaded optimizer state, and step 4's loss shows it
STRAIGHT_STEPS = 4
# the layouts that runs stopped after step 2 were made in (the `stopped_at_2` fixture; resumed by test_train_e2e.py
# in the same layout, by test_resume_layouts.py in another): name -> (overrides, nproc)
STOP_LAYOUTS = {
    "pp2_vpp2": (["--parallel.pp=2", "--parallel.vpp=2", "--train.micro_batch_size=1", "--checkpoint.interval=1"], 2),
    "dp2_ep2": (["--parallel.ep=2", "--parallel.zero=2"], 2),
}


def assert_same_run(got: list[dict], ref: list[dict], what: object = "") -> None:
    """Every step's loss and grad norm of ``got`` equal ``ref``'s up to fp32 summation order: another layout (or
    fp32 arithmetic reordered, as the fused AttnRes aggregation does) changes the roundings, and three Adam/Muon
    updates amplify them to ~1e-5 of the loss (two single-process runs of the same model, fused vs reference
    aggregation, differ by 1.1e-5 at step 4) -- the bound leaves 5x. A resume that lost optimizer state, router
    biases or the data position moves step 3's loss by 1e-3 or more."""
    assert [r["step"] for r in got] == [r["step"] for r in ref], what
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=5e-5, abs=5e-5), (what, a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-4), (what, a["step"])


def train_env(env_extra: dict[str, str | None] | None) -> dict[str, str]:
    env = rank_free_environ()
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath(ROOT))
    for k, v in (env_extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _with_out_dir(args: list[str]) -> list[str]:
    if any(a.startswith("--train.out_dir") for a in args):
        return args
    # never the config's own out_dir (runs/tiny: a user's `make train` run may be there)
    return [*args, f"--train.out_dir={tempfile.mkdtemp(prefix='k3train-test-run-')}"]


def run_train(args: list[str], nproc: int = 0, timeout: float = 600,
              env_extra: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """``python -m k3train.train`` (nproc 0) or ``torchrun --nproc_per_node=nproc -m k3train.train``, in a fresh
    temporary ``train.out_dir`` unless ``args`` names one.
    ``env_extra``: environment changes on top of the defaults (a value of None removes the variable)."""
    env = train_env(env_extra)
    args = _with_out_dir(args)
    if nproc:
        cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "-m", "k3train.train", *args]
    else:
        cmd = [PY, "-m", "k3train.train", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_train_forked(args: list[str], nproc: int = 0, timeout: float = 600,
                     env_extra: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """:func:`run_train` for the tests whose subject is what the trainer computes and writes, not the launcher or
    the interpreter: the same module run as ``__main__`` with the same arguments and environment, in one process
    (nproc 0) or ``nproc`` ranks, each forked from the session's fork server (k3train/runtime/local_workers.py
    ``run_module_ranks``: torch and k3train already imported, ~2-3 s of CPU less per process, and no torchrun
    agent process). The ranks get torchrun's variables (the env:// rendezvous torchrun's workers use), each its own
    session; as torchrun does, the first rank that fails has the others' sessions sent SIGTERM, then SIGKILL after
    a grace period. Returns the exit code (the first failing rank's, else 0) and the ranks' stdout and stderr,
    rank 0's first. At ``timeout`` every rank's session is killed and ``subprocess.TimeoutExpired`` raised.
    Variables that torch reads when it is imported (thread counts) cannot change in a forked rank: a test that
    sets them uses :func:`run_train`."""
    env = train_env(env_extra)
    fixed = [k for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if env.get(k) != os.environ.get(k)]
    assert not fixed, f"{fixed} are read when torch is imported (the fork server did): use run_train"
    return run_module_ranks("k3train.train", _with_out_dir(args), nproc, env, ROOT, timeout, preload=PRELOAD)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_ok(res: subprocess.CompletedProcess) -> None:
    """Fail with the run's output tails when it did not exit 0."""
    assert res.returncode == 0, f"exit {res.returncode}\nSTDOUT:\n{res.stdout[-3000:]}\nSTDERR:\n{res.stderr[-6000:]}"
