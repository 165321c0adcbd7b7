#!/usr/bin/env python
"""`make bench`: re-measure, on this machine, every performance and accuracy figure the docs and the dated results
under benchmarks/results/ claim, and print claimed against measured with the conditions they were measured under.

    .venv/bin/python benchmarks/bench_readme.py [--only RUN[,RUN]] [--json FILE] [--logs DIR] [--max-load 0.5] [--force]
    .venv/bin/python benchmarks/bench_readme.py --list          # the claims and runs, nothing measured

The claims (figure, the file and text that state it, the bound a measurement must meet) and the tool invocations
that measure them live in one place, benchmarks/bench_claims.py. Every run gets ``OMP_NUM_THREADS=1`` (one thread
per process, as the stated figures were taken), its own temporary directory, and its own ``K3TRAIN_CACHE_DIR`` in
it (the planner calibrates afresh: the user's cached calibration and MFU peak are neither used nor changed). Each
run's wall time is printed beside the estimate for an idle 2-core machine (about 35 minutes for all) and its limit.

A busy machine makes every timing wrong, so the script refuses (one line, exit 2) when, before it starts, the
1-minute load average is above ``--max-load`` (default 0.5: half a core of other work on average; it first waits
up to ``--settle-s`` for the load to fall, e.g. after make built the data), and again before each run when

  * the 1-minute load average, less what is left of the load measured when the previous run ended (all of it
    taken as the previous run's own: it decays as exp(-t / 60 s) when nothing else runs), is above the bound,
  * or other processes used more than ``--max-load`` cores during the previous run (the machine's busy CPU time
    from /proc/stat less this script's and its children's, over the run's wall time).

``--force`` runs regardless (the conditions then say so). Exit 0 when every claim of the runs chosen was
measured within its bound, 1 otherwise (out of bound, a run failed, timed out or printed no figure), 2 refused.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from k3train.planning.host_busy import IDLE_OTHERS_CORES, cpu_seconds  # noqa: E402
from bench_claims import (CLAIMS, FAST_MATMUL_GFLOPS, RUN_BY_NAME, RUNS, Claim, Measure, ParseError,  # noqa: E402
                          Run)

LOAD_TAU_S = 60.0  # the kernel's 1-minute load average decays as exp(-t / 60 s)
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


# ---------------------------------------------------------------------------------------------------------------
# conditions
# ---------------------------------------------------------------------------------------------------------------
def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best one-thread fp32 ``n x n`` matmul rate of this host (GFLOP/s)."""
    import torch  # lazy: --list and a refusal on a busy machine answer without loading torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * n ** 3 / best / 1e9


def host_conditions() -> dict[str, Any]:
    """What a measurement depends on: CPU and its vector units, cores, torch, the matmul rate, date, commit."""
    import torch  # lazy: --list and a refusal on a busy machine answer without loading torch

    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and not model:
                model = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += "+changes" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
            "cpu": model, "flags": [f for f in FLAGS if f in flags], "avx512": "avx512f" in flags,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu_count": os.cpu_count(), "threads_per_process": 1, "matmul_gflops_1thread": round(matmul_gflops(), 1),
            "python": platform.python_version(), "commit": commit}


def format_conditions(c: dict[str, Any]) -> str:
    flags = " ".join(c["flags"]) or "none of " + "/".join(FLAGS)
    forced = "; --force: the load was not checked" if c.get("forced") else ""
    return "\n".join([
        f"date {c['date']}, host {c['host']}, commit {c['commit']}",
        f"cpu {c['cpu']}: {c['cores']} cores usable of {c['cpu_count']}; flags {flags}; avx512 "
        f"{'yes' if c['avx512'] else 'no'}; torch {c['torch']} (cpu capability {c['torch_cpu_capability']}), "
        f"python {c['python']}",
        f"threads per process {c['threads_per_process']} (OMP_NUM_THREADS=1 in every run); one-thread fp32 2048^3 "
        f"matmul {c['matmul_gflops_1thread']} GFLOP/s; 1-minute load average at the start "
        f"{c.get('load_at_start', float('nan')):.2f}{forced}"])


# ---------------------------------------------------------------------------------------------------------------
# how busy the machine is
# ---------------------------------------------------------------------------------------------------------------
_SUBREAPER = [False]


def become_subreaper() -> None:
    """Orphaned descendants of a run (a worker whose launcher died) are reparented to this process, so that their
    CPU time, once reaped, counts as the run's own and not as another process's (Linux; elsewhere a no-op)."""
    try:
        _SUBREAPER[0] = ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def reap_orphans() -> None:
    """Reap the orphans :func:`become_subreaper` adopted (only then: in another process, such as a test runner,
    this would reap children that belong to someone else)."""
    if not _SUBREAPER[0]:
        return
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def end_group(pgid: int, grace_s: float = 10.0) -> None:
    """After a run's main process ended: wait until the rest of its process group has ended too (at most
    ``grace_s``, then kill it), reaping the orphans adopted meanwhile -- a multiprocessing fork server that exits
    just after the run, with the CPU of the ranks it reaped, is the run's own work, not another process's."""
    deadline = time.monotonic() + grace_s
    while True:
        reap_orphans()
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            time.sleep(0.1)
            reap_orphans()
            return
        time.sleep(0.05)


@dataclass
class LoadGuard:
    """The busy-machine checks of the module docstring. ``load`` returns the load averages (os.getloadavg)."""
    max_load: float
    load: Callable[[], tuple[float, float, float]] = os.getloadavg
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    end_load: float = 0.0
    end_t: float = 0.0
    others_cores: float = 0.0   # other processes' CPU during the previous run
    previous: str = ""

    def at_start(self, settle_s: float) -> str:
        """'' when idle (after waiting up to ``settle_s`` for the load to fall), else the reason."""
        deadline = self.clock() + settle_s
        load1 = self.load()[0]
        if load1 > self.max_load and settle_s > 0:
            print(f"waiting up to {settle_s:.0f} s for the 1-minute load average ({load1:.2f}) to fall to "
                  f"{self.max_load} ...", flush=True)
        while load1 > self.max_load and self.clock() < deadline:
            self.sleep(min(5.0, max(0.0, deadline - self.clock())))
            load1 = self.load()[0]
        if load1 > self.max_load:
            return (f"the machine is busy: 1-minute load average {load1:.2f} > {self.max_load} (--max-load)"
                    + (f" after waiting {settle_s:.0f} s" if settle_s > 0 else ""))
        return ""

    def before(self, name: str) -> str:
        """'' when nothing but this benchmark's previous run has loaded the machine, else the reason."""
        if not self.previous:
            return ""
        if self.others_cores > self.max_load:
            return (f"the machine became busy during '{self.previous}': other processes used "
                    f"{self.others_cores:.2f} cores > {self.max_load} (--max-load)")
        load1 = self.load()[0]
        other = load1 - self.end_load * math.exp(-(self.clock() - self.end_t) / LOAD_TAU_S)
        if other > self.max_load:
            return (f"the machine is busy before '{name}': 1-minute load average {load1:.2f}, of which {other:.2f} "
                    f"is not left from '{self.previous}' > {self.max_load} (--max-load)")
        return ""

    def after(self, name: str, others_cores: float) -> None:
        self.previous, self.others_cores = name, (others_cores if math.isfinite(others_cores) else 0.0)
        self.end_load, self.end_t = self.load()[0], self.clock()


# ---------------------------------------------------------------------------------------------------------------
# running the tools
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    rc: int | None              # None: killed at its time limit
    out: str
    err: str
    wall_s: float
    others_cores: float = math.nan
    timeout_s: float = 0.0


def execute(run: Run, tmp: Path, timeout_s: float) -> Outcome:
    """``run`` with this interpreter in the checkout, its own process group (killed whole at the limit)."""
    argv = [sys.executable, *(a.replace("{tmp}", str(tmp)) for a in run.argv)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    from k3train.runtime.process_groups import child_pythonpath  # noqa: PLC0415 # lazy: the module loads torch
    env.update(OMP_NUM_THREADS="1", K3TRAIN_CACHE_DIR=str(tmp / "cache"), WANDB_MODE="disabled",
               PYTHONPATH=child_pythonpath(ROOT))
    (tmp / "cache").mkdir(parents=True, exist_ok=True)
    busy0, mine0 = cpu_seconds()
    t0 = time.perf_counter()
    with open(tmp / "stdout", "w+") as out, open(tmp / "stderr", "w+") as err:
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            rc: int | None = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
        if rc is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        wall = time.perf_counter() - t0
        end_group(p.pid)
        busy1, mine1 = cpu_seconds()
        out.seek(0)
        err.seek(0)
        return Outcome(rc, out.read(), err.read(), wall, ((busy1 - busy0) - (mine1 - mine0)) / max(wall, 1e-9),
                       timeout_s)


@dataclass
class Row:
    claim: Claim
    measure: Measure | None
    within: bool
    claimed: str
    bound: float
    note: str = ""


@dataclass
class Report:
    conditions: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        claims = [{"key": r.claim.key, "run": r.claim.run, "figure": r.claim.figure, "claimed": r.claimed,
                   "op": r.claim.op, "bound": r.bound, "file": r.claim.file, "text": r.claim.text,
                   "measured": None if r.measure is None or not math.isfinite(r.measure.value) else r.measure.value,
                   "measured_text": r.measure.text if r.measure else None,
                   "detail": r.measure.detail if r.measure else r.note, "within": r.within} for r in self.rows]
        return {"conditions": self.conditions, "runs": self.runs, "claims": claims,
                "ok": bool(self.rows) and all(r.within for r in self.rows)}


def judge(run: Run, outcome: Outcome | None, why_not: str, matmul_gflops: float) -> list[Row]:
    """The rows of ``run``'s claims from its outcome (None: not run, ``why_not`` says why). A bound that depends
    on the host's matmul rate takes the rate the tool measured beside its figure, else ``matmul_gflops``."""
    claims = [c for c in CLAIMS if c.run == run.name]

    def unmeasured(c: Claim, note: str) -> Row:
        return Row(c, None, False, c.claimed(matmul_gflops), c.bound_for(matmul_gflops), note)

    if outcome is None:
        return [unmeasured(c, why_not) for c in claims]
    if outcome.rc is None:
        return [unmeasured(c, f"killed at its limit of {outcome.timeout_s:.0f} s") for c in claims]
    if outcome.rc not in run.ok_exit:
        return [unmeasured(c, f"exit {outcome.rc}") for c in claims]
    try:
        measures = run.parse(outcome.out)
    except (ParseError, KeyError, ValueError, TypeError, ZeroDivisionError) as e:
        return [unmeasured(c, f"no figure: {e}") for c in claims]
    rows = []
    for c in claims:
        m = measures.get(c.key)
        if m is None:
            rows.append(unmeasured(c, "not in the output"))
            continue
        mm = m.matmul_gflops if math.isfinite(m.matmul_gflops) else matmul_gflops
        rows.append(Row(c, m, c.within(m.value, mm), c.claimed(mm), c.bound_for(mm)))
    return rows


def format_table(rows: list[Row]) -> str:
    head = ("figure", "claimed; bound", "measured", "within", "run")
    cells = [(r.claim.figure, r.claimed, r.measure.text if r.measure else "-",
              "yes" if r.within else "NO", r.claim.run) for r in rows]
    w = [max(len(x[i]) for x in [head, *cells]) for i in range(len(head))]
    line = lambda xs: "  ".join(x.ljust(w[i]) for i, x in enumerate(xs)).rstrip()  # noqa: E731
    out = [line(head), "-" * (sum(w) + 2 * (len(w) - 1)), *map(line, cells)]
    notes = [f"  {r.claim.key}: {r.measure.detail if r.measure else r.note}" for r in rows
             if (r.measure and r.measure.detail) or r.note]
    return "\n".join(out + (["notes:", *notes] if notes else []))


def list_claims() -> str:
    lines = ["runs (expected wall time on an idle 2-core machine; limit):"]
    for r in RUNS:
        lines.append(f"  {r.name:<15} ~{r.expected_s:>4} s (limit {r.timeout_s} s)  {' '.join(r.argv)}")
        lines.append(f"  {'':<15} {r.conditions}")
    lines.append(f"  total ~{sum(r.expected_s for r in RUNS) / 60:.0f} minutes")
    lines.append(f"claims (after '/': the bound beside a one-thread matmul over {FAST_MATMUL_GFLOPS:g} GFLOP/s):")
    for c in CLAIMS:
        alt = f" / {c.fast_matmul_bound:g}{c.unit}" if c.fast_matmul_bound is not None else ""
        lines.append(f"  {c.key:<22} {c.run:<15} {c.op} {c.bound:g}{c.unit}{alt}   {c.file}: {c.text!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, load: Callable[[], tuple[float, float, float]] = os.getloadavg,
         runner: Callable[[Run, Path, float], Outcome] = execute,
         conditions: Callable[[], dict[str, Any]] = host_conditions, sleep: Callable[[float], None] = time.sleep
         ) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/bench_readme.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma-separated runs: {','.join(RUN_BY_NAME)}")
    ap.add_argument("--json", default="", metavar="FILE", help="write the conditions, runs and claims as JSON")
    ap.add_argument("--logs", default="", metavar="DIR", help="keep each run's stdout and stderr in DIR/RUN.log")
    ap.add_argument("--max-load", type=float, default=IDLE_OTHERS_CORES, help="busy above this (see above)")
    ap.add_argument("--settle-s", type=float, default=60.0, help="at the start, wait this long for the load to fall")
    ap.add_argument("--budget-s", type=float, default=40 * 60,
                    help="stop starting runs after this many seconds (their claims count as not measured)")
    ap.add_argument("--force", action="store_true", help="run even on a busy machine")
    ap.add_argument("--list", action="store_true", help="print the claims and the runs, measure nothing")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n] or list(RUN_BY_NAME)
    unknown = [n for n in names if n not in RUN_BY_NAME]
    if unknown or a.max_load < 0:
        print("bench_readme: error: " + (f"--only: unknown run(s) {', '.join(unknown)}; the runs are "
                                          f"{', '.join(RUN_BY_NAME)}" if unknown else "--max-load must be >= 0"),
              file=sys.stderr)
        return 2
    if a.list:
        print(list_claims())
        return 0
    guard = LoadGuard(a.max_load, load=load, sleep=sleep)
    t_start = time.monotonic()
    if not a.force:
        busy = guard.at_start(a.settle_s)
        if busy:
            print(f"bench_readme: {busy}; run it on an idle machine, or pass --force", file=sys.stderr)
            return 2
    cond = {**conditions(), "load_at_start": load()[0], "forced": a.force, "max_load": a.max_load}
    mm = float(cond.get("matmul_gflops_1thread", math.nan))
    print(format_conditions(cond), flush=True)
    runs = [r for r in RUNS if r.name in names]
    report = Report(cond)
    logs = Path(a.logs) if a.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    if runner is execute:
        become_subreaper()
    for i, run in enumerate(runs, 1):
        left = a.budget_s - (time.monotonic() - t_start)
        if left < 1:
            report.rows += judge(run, None, f"not run: over --budget-s {a.budget_s:.0f}", mm)
            continue
        busy = "" if a.force else guard.before(run.name)
        if busy:
            print(f"bench_readme: {busy}; run it on an idle machine, or pass --force", file=sys.stderr)
            return 2
        print(f"[{i}/{len(runs)}] {run.name}: {' '.join(run.argv)}  ({run.conditions})", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"k3bench_{run.name}_") as tmp:
            o = runner(run, Path(tmp), min(run.timeout_s, left))
        guard.after(run.name, o.others_cores)
        status = "killed at the limit" if o.rc is None else f"exit {o.rc}"
        print(f"    {o.wall_s:.1f} s (expected ~{run.expected_s} s on an idle 2-core machine; limit "
              f"{o.timeout_s:.0f} s), {status}, other processes' CPU {o.others_cores:.2f} cores", flush=True)
        if logs:
            (logs / f"{run.name}.log").write_text(f"$ {' '.join(run.argv)}\n{o.out}\n--- stderr ---\n{o.err}")
        rows = judge(run, o, "", mm)
        if not all(r.measure for r in rows):
            tail = (o.err.strip() or o.out.strip()).splitlines()[-12:]
            print("    " + "\n    ".join(tail), flush=True)
        report.runs.append({"name": run.name, "argv": list(run.argv), "conditions": run.conditions,
                            "wall_s": round(o.wall_s, 1), "expected_s": run.expected_s, "limit_s": o.timeout_s,
                            "exit": o.rc, "others_cores": None if not math.isfinite(o.others_cores) else
                            round(o.others_cores, 3)})
        report.rows += rows
    print()
    print(format_table(report.rows))
    total = sum(r["wall_s"] for r in report.runs)
    res = report.as_json()
    print(format_conditions(cond))
    print(f"{sum(r.within for r in report.rows)} of {len(report.rows)} claims within their bounds; runs took "
          f"{total / 60:.1f} min")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
