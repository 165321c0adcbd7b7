#!/usr/bin/env python
"""EAGLE-3 draft benchmark: LK-trained vs KL-trained drafts from the same MTP initialisation (issue 30).

1. Trains a tiny target the way ``make train`` does (``configs/tiny.yaml``, its MTP layer included; one process,
   ``--target-steps``) into a temporary directory -- or takes ``--target PATH`` (a step directory).
2. The acceptance of the untrained draft (W_E3 = [0 0 I], the pre-trained MTP layer) on the validation split:
   the real trainer built in this process, its evaluator run before any step.
3. Two draft runs of the real trainer (``python -m k3train.train``, one process), ``train.draft_loss=lk`` and
   ``kl``: the same target, initialisation, batches, optimizer and steps.

Printed: per draft step the acceptance ``sum_x min(p, q)`` on the validation split (``val_draft_accept``) and the
expected accepted length of the chain (``val_draft_accept_len``; definitions in k3train/draft/objective.py), for
the untrained draft and after LK and KL training; each run's validation objective; and the median step time (the
machine may be shared: say so when quoting it).

Example: ``python benchmarks/bench_draft.py --target-steps 200 --steps 150`` (about 10 minutes on 2 idle cores).
Any ``--section.key=value`` override applies to the draft runs (e.g. ``--optim.lr=1e-3``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3train.preflight import validate_run  # noqa: E402
from k3train.trainer import Trainer  # noqa: E402


def run(args: list[str], out: Path) -> list[dict]:
    """One single-process run of the trainer; returns its metrics.jsonl records."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "k3train.train", *args, f"--train.out_dir={out}",
                          "--checkpoint.resume=none", "--logging.wandb=false", "--logging.peak_flops=1e9"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"run failed (exit {res.returncode}): {' '.join(args)}\n{res.stderr[-3000:]}")
    print(f"# {out.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def untrained(args: list[str], out: Path) -> dict:
    """The validation metrics of the draft at its initialisation (the trainer's own evaluator, before a step)."""
    cfg = validate_run(args[1], [*args[2:], "--train.eval_interval=1", f"--train.out_dir={out}",
                                 "--checkpoint.resume=none",
                                 "--logging.wandb=false", "--logging.peak_flops=1e9", "--logging.level=WARNING"])
    tr = Trainer(cfg)
    try:
        return tr.evaluator.evaluate()
    finally:
        tr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--target", default="", help="a target checkpoint (step directory); default: train one")
    ap.add_argument("--target-steps", type=int, default=200, help="steps of the target run (make train: 200)")
    ap.add_argument("--steps", type=int, default=150, help="draft training steps (each loss)")
    ap.add_argument("--eval-iters", type=int, default=10, help="validation global batches")
    ap.add_argument("--blocks", default="[1,2]", help="train.draft_feature_blocks (tiny has 2 completed blocks)")
    ap.add_argument("--work-dir", default="", help="keep the runs here (a new directory; default: a temporary one)")
    a, overrides = ap.parse_known_args()
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)} (overrides are --section.key=value)")
    if a.work_dir and Path(a.work_dir).exists():
        ap.error(f"--work-dir {a.work_dir} exists (the benchmark writes new runs only)")
    with tempfile.TemporaryDirectory(prefix="k3train-bench-draft-") as tmp:
        tmp = Path(a.work_dir or tmp)
        target = Path(a.target) if a.target else None
        if target is None:
            recs = run(["--config", a.config, f"--train.steps={a.target_steps}", "--checkpoint.interval=0"],
                       tmp / "target")
            target = tmp / "target" / "checkpoints" / f"step_{a.target_steps:08d}"
            print(f"# target: {a.target_steps} steps, loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}")
        draft = ["--config", a.config, "--train.objective=eagle3", f"--checkpoint.target={target}",
                 f"--train.draft_feature_blocks={a.blocks}", f"--train.eval_iters={a.eval_iters}",
                 "--checkpoint.save_final=false", *overrides]
        init = untrained(draft, tmp / "init")
        res = {}
        for kind in ("lk", "kl"):
            res[kind] = run([*draft, f"--train.draft_loss={kind}", f"--train.steps={a.steps}",
                             f"--train.eval_interval={a.steps}"], tmp / kind)
    last = {k: [r for r in v if "val_draft_accept" in r][-1] for k, v in res.items()}
    steps = len(init["val_draft_accept"])
    print(f"\nconfig {a.config}; draft = the MTP layer + W_E3 (blocks {a.blocks} + the final aggregation), "
          f"{a.steps} steps per loss; validation split, {a.eval_iters} global batches")
    print(f"{'':24s} {'untrained':>10s} {'LK':>10s} {'KL':>10s}")
    for j in range(steps):
        print(f"{'accept step ' + str(j + 1):24s} {init['val_draft_accept'][j]:10.4f} "
              f"{last['lk']['val_draft_accept'][j]:10.4f} {last['kl']['val_draft_accept'][j]:10.4f}")
    print(f"{'expected accepted len':24s} {init['val_draft_accept_len']:10.4f} "
          f"{last['lk']['val_draft_accept_len']:10.4f} {last['kl']['val_draft_accept_len']:10.4f}   (of {steps})")
    print(f"{'val objective':24s} {'':>10s} {last['lk']['val_loss']:10.4f} {last['kl']['val_loss']:10.4f}"
          f"   (LK: sum_j -log accept_j; KL: sum_j KL(p||q))")
    for k in ("lk", "kl"):
        times = [r["step_time_s"] for r in res[k][5:]] or [r["step_time_s"] for r in res[k]]
        print(f"{k} run: train loss {res[k][0]['loss']:.4f} -> {res[k][-1]['loss']:.4f}, "
              f"median step {statistics.median(times) * 1e3:.0f} ms")
    d = last["lk"]["val_draft_accept_len"] - last["kl"]["val_draft_accept_len"]
    print(f"LK - KL expected accepted length: {d:+.4f} ({'LK' if d > 0 else 'KL'} higher)")


if __name__ == "__main__":
    main()
