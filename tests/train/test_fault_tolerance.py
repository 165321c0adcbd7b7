"""A dead or stuck rank never hangs the job; preemption and Ctrl-C stop every rank at one step with a checkpoint.

Real ``torchrun`` runs of the tiny config (2 ranks, pp=2), killed or signalled from outside while they train:
    * kill -9 of a rank mid-step: torchrun exits non-zero well within ``parallel.collective_timeout_s``, the
      survivor prints one line naming the collective and its group, and re-running resumes exactly;
    * SIGSTOP of a rank (stuck, not dead: torchrun cannot notice): the survivor's collective times out after
      ``collective_timeout_s`` and it exits with the one line;
    * kill -9 while a checkpoint is being written (held open by the fault-injection hook of
      k3train/runtime/fault_injection.py): the previous checkpoint is the one resumed, exactly;
    * SIGTERM to torchrun: both ranks stop after the same step, its checkpoint is written, one line, exit code of
      the workers 143, and re-running resumes exactly.
"Exactly": the per-step losses and gradient norms of the interrupted-and-resumed run equal those of one
uninterrupted run of the same layout, bit for bit. The two kills and the SIGTERM interrupt one run directory in
turn (each re-run of the command resumes, and is the next interruption's victim); SIGSTOP and the stop checkpoint
past its deadline are runs of their own.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_helpers import run_distributed
from train_helpers import FAST, ROOT, TORCHRUN, assert_ok, read_metrics, run_train_forked, train_env

# 8 steps, a checkpoint every 2: the chained interruptions of the test below each need a complete checkpoint
# behind them and (SIGTERM) steps ahead
STEPS = 8
LAYOUT = ["--parallel.pp=2", "--checkpoint.interval=2", "--checkpoint.resume=auto", "--checkpoint.keep=5"]
TIMEOUT_S = 20  # parallel.collective_timeout_s of these runs
# the stuck-rank run's: it waits out the whole timeout, so a shorter one saves that wait; 8 s still leaves that run's
# normal waits (start-up, the step-2 save, one rank's 7 layers vs the other's 1) far inside it on 2 loaded cores
STUCK_TIMEOUT_S = 8


def _args(prefix: Path, out: Path, timeout_s: int = TIMEOUT_S) -> list[str]:
    return ["--config", "configs/tiny.yaml", f"--data.path={prefix}", f"--train.out_dir={out}",
            f"--train.steps={STEPS}", *FAST, *LAYOUT, f"--parallel.collective_timeout_s={timeout_s}"]


def _launch(args: list[str], out: Path, tag: str = "first", **env: str) -> subprocess.Popen:
    """torchrun in the background; its stdout/stderr go to ``<out>.<tag>.log`` / ``.err`` (beside ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "k3train.train", *args]
    with open(f"{out}.{tag}.log", "w") as so, open(f"{out}.{tag}.err", "w") as se:
        return subprocess.Popen(cmd, cwd=ROOT, env=train_env(env), stdout=so, stderr=se, text=True)


def _stderr(out: Path, tag: str = "first") -> str:
    return Path(f"{out}.{tag}.err").read_text()


def _run(args: list[str], out: Path, tag: str = "rerun") -> str:
    p = _launch(args, out, tag)
    rc = p.wait(timeout=300)
    err = _stderr(out, tag)
    assert rc == 0, f"exit {rc}\n{err[-6000:]}"
    return err


def _workers(torchrun_pid: int) -> dict[int, int]:
    """{global rank: pid} of torchrun's worker processes (its children carrying RANK in their environment)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(d.name)
    return out


def _wait_for(cond, proc: subprocess.Popen, what: str, limit: float = 180) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert proc.poll() is None, f"run ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _logged_steps(out: Path) -> list[int]:
    try:
        return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def _complete(out: Path) -> list[str]:
    return sorted(p.parent.name for p in (out / "checkpoints").glob("step_*/COMPLETE"))


def _assert_same_run(out: Path, reference: list[dict]) -> None:
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in reference]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in reference]


def _k3_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("k3train:")]


@pytest.fixture(scope="module")
def reference(corpus_prefix, tmp_path_factory) -> list[dict]:
    """The same command, never interrupted: the same arguments and environment on two ranks forked with
    torchrun's worker variables (``run_train_forked``; the launcher is what the interruptions test, not this)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(run_train_forked(_args(corpus_prefix, out), nproc=2))
    return read_metrics(out)


def _launch_steps(out: Path, tag: str) -> list[int]:
    """Steps whose progress line the launch ``tag`` printed (rank 0's stdout): what THIS launch trained, where
    metrics.jsonl may still hold the records a killed launch logged after its checkpoint until the re-run drops
    them."""
    try:
        return [int(m) for m in re.findall(r"^step\s+(\d+)/", Path(f"{out}.{tag}.log").read_text(), re.M)]
    except OSError:
        return []


def _kill9_mid_save(prefix: Path, out: Path, pause_log: Path) -> None:
    """A fresh run; kill -9 of rank 1 while both ranks are inside the step-4 save (held by the fault hook before
    COMPLETE): the interrupted save does not count, step 2 stays the latest checkpoint."""
    # each rank sleeps 4 s after logging its pause; the kill follows the second rank's log within one 0.05 s poll
    # (and a /proc scan), so rank 1 is still inside its pause when it dies
    p = _launch(_args(prefix, out), out, "kill9_save", K3TRAIN_FAULT_PAUSE="checkpoint_before_complete:4:4",
                K3TRAIN_FAULT_PAUSE_LOG=str(pause_log))
    _wait_for(lambda: pause_log.is_file() and pause_log.read_text().count("rank=") == 2, p,
              "both ranks inside the step-4 save")
    assert (out / "checkpoints" / ".tmp_step_00000004").is_dir()
    os.kill(_workers(p.pid)[1], signal.SIGKILL)
    rc = p.wait(timeout=120)
    assert rc != 0
    assert _complete(out) == ["step_00000002"], "the interrupted step-4 save must not count"


def _kill9_mid_step(prefix: Path, out: Path) -> None:
    """The same command again resumes from step 2 (the killed save left none newer); kill -9 of rank 0 after
    this launch's first step (3): torchrun exits non-zero well within the collective timeout, the survivor prints
    one line naming the collective and its group, no worker traceback."""
    p = _launch(_args(prefix, out), out, "kill9_step")
    _wait_for(lambda: 3 in _launch_steps(out, "kill9_step"), p, "step 3")
    victim = _workers(p.pid)[0]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    rc = p.wait(timeout=TIMEOUT_S + 60)
    elapsed = time.monotonic() - t0
    err = _stderr(out, "kill9_step")
    print(f"kill -9 of rank 0 -> torchrun exit {rc} after {elapsed:.2f}s; {_k3_lines(err)}")
    assert "resumed from" in err and "step_00000002 at step 2" in err, err[-3000:]
    assert rc != 0
    assert elapsed < TIMEOUT_S + 30, elapsed
    lines = _k3_lines(err)
    assert len(lines) == 1, err[-4000:]
    assert re.match(r"k3train: error: rank 1: collective \w+ on group \w+ \(ranks \[[\d, ]+\]\) failed", lines[0]), \
        lines[0]
    assert f'File "{ROOT / "k3train"}' not in err, err[-4000:]  # no traceback from a worker


def _sigterm(prefix: Path, out: Path) -> int:
    """The same command again resumes from the newest complete checkpoint (step 2, or 4 had the kill above
    landed after that save); SIGTERM to torchrun after this launch's first step: both ranks stop after the same
    step with its checkpoint, one line, no worker traceback. Returns that step."""
    latest = int(_complete(out)[-1].split("_")[1])
    p = _launch(_args(prefix, out), out, "sigterm")
    _wait_for(lambda: latest + 1 in _launch_steps(out, "sigterm"), p, f"step {latest + 1}")
    p.send_signal(signal.SIGTERM)  # what a cluster scheduler does; torchrun forwards it to both workers
    rc = p.wait(timeout=120)
    err = _stderr(out, "sigterm")
    assert "resumed from" in err and f"step_{latest:08d} at step {latest}" in err, err[-3000:]
    assert rc != 0  # torchrun itself re-raises the signal
    lines = _k3_lines(err)
    assert len(lines) == 1, err[-4000:]
    m = re.fullmatch(r"k3train: stopped by SIGTERM at step (\d+); checkpoint (step_\d+) written .*", lines[0])
    assert m, lines[0]
    step = int(m.group(1))
    assert latest < step < STEPS and m.group(2) == f"step_{step:08d}" and m.group(2) in _complete(out)
    assert _logged_steps(out)[-1] == step
    assert f'File "{ROOT / "k3train"}' not in err, err[-4000:]
    return step


def test_kill9_mid_save_then_mid_step_then_sigterm_each_resume_exactly(corpus_prefix, tmp_path, reference):
    """One run directory interrupted three ways in turn, each by a re-run of the same command that resumed where
    the previous launch left it: kill -9 of a rank inside a checkpoint save, kill -9 of a rank mid-step, SIGTERM
    (preemption) to torchrun; a last re-run finishes. Every step in the directory -- those of each resumed launch
    before its interruption and the last one's -- equals the uninterrupted run's, bit for bit. (Each
    interruption's re-run is the next one's victim: as three tests they paid for three fresh launches and three
    re-runs, here for one and three.)"""
    out = tmp_path / "run"
    _kill9_mid_save(corpus_prefix, out, tmp_path / "paused.log")
    _kill9_mid_step(corpus_prefix, out)
    step = _sigterm(corpus_prefix, out)
    err = _run(_args(corpus_prefix, out), out)  # the same command again finishes the run
    assert f"step_{step:08d} at step {step}" in err
    _assert_same_run(out, reference)


def _gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_stuck_rank_times_out_with_one_line(corpus_prefix, tmp_path):
    """SIGSTOP: the process lives, so torchrun notices nothing and only the collective timeout can end its peer's
    wait. The survivor must exit on its own within collective_timeout_s (+ slack) with the one line; the test
    then SIGKILLs the stopped rank, as torchrun would 30 s later (its fixed grace after a worker failure)."""
    out = tmp_path / "run"
    p = _launch(_args(corpus_prefix, out, STUCK_TIMEOUT_S), out)
    _wait_for(lambda: 2 in _logged_steps(out), p, "step 2")
    workers = _workers(p.pid)
    t0 = time.monotonic()
    os.kill(workers[1], signal.SIGSTOP)
    try:
        while not _gone(workers[0]) and time.monotonic() - t0 < STUCK_TIMEOUT_S + 60:
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(workers[1], signal.SIGKILL)
    rc = p.wait(timeout=60)
    err = _stderr(out)
    print(f"SIGSTOP of rank 1 -> rank 0 exited after {elapsed:.2f}s (collective timeout {STUCK_TIMEOUT_S}s); "
          f"{_k3_lines(err)}")
    assert rc != 0
    assert STUCK_TIMEOUT_S * 0.9 < elapsed < STUCK_TIMEOUT_S + 30, elapsed
    lines = _k3_lines(err)
    assert len(lines) == 1, err[-4000:]
    assert re.match(r"k3train: error: rank 0: collective \w+ on group \w+ .*failed: peer rank 1 did not answer "
                    rf"within {STUCK_TIMEOUT_S} s", lines[0]), lines[0]


def test_stop_checkpoint_past_the_deadline_keeps_the_last_one(corpus_prefix, tmp_path):
    """Only rank 1 gets SIGTERM: the per-step MAX agreement stops rank 0 after the same step. Their checkpoint
    cannot finish within checkpoint.preempt_timeout_s (held by the fault hook): both exit at the deadline with one
    line and exit code 143 (which torchrun reports for each), and the previous complete checkpoint stays."""
    out = tmp_path / "run"
    p = _launch(_args(corpus_prefix, out) + ["--checkpoint.preempt_timeout_s=4"], out,
                K3TRAIN_FAULT_PAUSE="checkpoint_before_complete:3+:120")
    _wait_for(lambda: 3 in _logged_steps(out), p, "step 3")
    t0 = time.monotonic()
    os.kill(_workers(p.pid)[1], signal.SIGTERM)
    rc = p.wait(timeout=120)
    elapsed = time.monotonic() - t0
    err = _stderr(out)
    assert rc != 0 and elapsed < 4 + 20, (rc, elapsed)
    lines = _k3_lines(err)
    assert len(lines) == 1, err[-4000:]
    assert re.fullmatch(r"k3train: error: stopped by SIGTERM, but the checkpoint after step \d+ was not written "
                        r"within checkpoint.preempt_timeout_s=4s; the last complete checkpoint stays: step_00000002",
                        lines[0]), lines[0]
    assert _complete(out) == ["step_00000002"]
    assert re.findall(r"exitcode\s*:\s*(-?\d+) \(pid", err) == ["143", "143"], err[-3000:]


# ----------------------------------------------------------------------------------------------------------------
# the per-step agreement, and the test helper itself
def _agree_body(rank: int, world_size: int) -> None:
    import torch  # noqa: PLC0415

    from k3train.runtime.signals import StopSignals  # noqa: PLC0415

    s = StopSignals(rank, torch.device("cpu"), deadline_s=60, on_deadline=lambda sig: "")
    assert s.agree() == 0
    if rank == 1:
        s._on_signal(signal.SIGINT, None)
    assert s.agree() == signal.SIGINT  # one rank's signal stops every rank at the same boundary
    if rank == 0:
        s._on_signal(signal.SIGTERM, None)
    assert s.agree() == signal.SIGTERM  # MAX: SIGTERM (15) wins over SIGINT (2)
    s.disarm()


def test_stop_flag_agreement_over_ranks():
    run_distributed(_agree_body, 2)


def _dies_body(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_run_distributed_names_a_rank_killed_by_a_signal():
    with pytest.raises(AssertionError, match=r"rank 1 died without reporting: killed by SIGKILL \(exit code -9\)"):
        run_distributed(_dies_body, 2, timeout=120)


def _groups_and_watch_body(rank: int, world_size: int) -> None:
    from datetime import timedelta  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from k3train.runtime.collective_errors import CollectiveWatch  # noqa: PLC0415
    from parallel.dims import ParallelDims  # noqa: PLC0415

    def timeout(g):  # noqa: ANN001, ANN202
        return g._get_backend(torch.device("cpu")).options._timeout

    world = timeout(dist.group.WORLD)
    dp = ParallelDims(dp=2, world_size=2, rank=rank).build_groups(timeout_s=30).group("dp")
    assert dp.group_desc == "dp" and timeout(dp) == timedelta(seconds=30)
    inherited = ParallelDims(dp=2, world_size=2, rank=rank).build_groups().group("dp")
    assert timeout(inherited) == world != timedelta(minutes=30)  # not torch's new_group default
    watch = CollectiveWatch().install()
    try:
        dist.barrier()
        if rank == 1:
            os._exit(7)
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(4), group=dp)
        line = watch.failure_line(RuntimeError("whatever the caller re-raised"), rank)
        assert re.match(r"k3train: error: rank 0: collective all_reduce on group dp \(ranks \[0, 1\]\) failed: "
                        r"peer rank 1 closed the connection: it died \[RuntimeError: .*\]$", line), line
        assert watch.failure_line(ValueError("not distributed"), rank) == line  # the recorded failure wins
        assert CollectiveWatch().failure_line(ValueError("a bug"), rank) is None
    finally:
        watch.uninstall()
    raise SystemExit("rank 0 checks passed")  # reported as this rank's error, so the test sees it ran


def test_groups_get_the_run_timeout_and_a_dead_peer_is_named():
    with pytest.raises(AssertionError) as ei:
        run_distributed(_groups_and_watch_body, 2, timeout=120)
    msg = str(ei.value)
    assert msg.startswith("rank 1 died without reporting: exit code 7"), msg
    assert "SystemExit: rank 0 checks passed" in msg, msg
