"""A layout's real step time on this host (``tools/plan.py --measure``), and the rank correlation of predicted
against measured."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from k3train.planning.calibration.host import child_env

PHASES = ("step_time_s", "time_forward_backward_s", "time_grad_norm_s", "time_optimizer_s")


def measure_step(config: str, overrides: list[str], world: int, steps: int = 4, threads: int = 1,
                 timeout: float = 1800) -> dict[str, float]:
    """Medians of ``PHASES`` (metrics.jsonl: the step, and rank 0's forward+backward, gradient norm and optimizer
    step) over steps 3..``steps`` (2..``steps`` for fewer than 5 steps) of a real torchrun training run
    (``threads`` intra-op threads per rank: the calibration's). The first two steps are warm-up: the first
    allocates optimizer state, and the second was still 5-10% slower in runs here."""
    root = Path(__file__).resolve().parents[3]
    with tempfile.TemporaryDirectory(prefix="k3plan_") as tmp:
        env = child_env(root, str(threads))
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", f"--nproc_per_node={world}", "-m", "k3train.train", "--config", config,
               *overrides, f"--train.out_dir={tmp}/run", f"--train.steps={steps}", "--checkpoint.resume=none",
               "--checkpoint.interval=0", "--checkpoint.save_final=false", "--logging.wandb=false",
               "--logging.peak_flops=1e12", "--train.eval_interval=0"]
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"measure run failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
        recs = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    skip = 2 if steps >= 5 else 1
    kept = [r for r in recs if r["step"] > skip]
    if not kept:
        raise RuntimeError("measure run logged no step after the first")
    out = {}
    for k in PHASES:
        ts = sorted(r.get(k, float("nan")) for r in kept)
        out[k] = ts[len(ts) // 2]
    return out


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        out = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else float("nan")
