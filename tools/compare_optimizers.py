"""Muon (+AdamW for non-matrices) vs plain AdamW on the same tokens: loss after N steps, from real training runs.

    python tools/compare_optimizers.py --config configs/small.yaml --steps 30 [--nproc 1] [--train.seq_len=128 ...]

Any other argument is a config override, written as for the trainer: ``--section.key=value``.

Runs the trainer once per optimizer (same config, seed and global batches; only ``optim.name`` differs), then prints
the loss at a few steps and the mean of the last 5 steps. Each run's metrics stay in ``<out>/<name>/metrics.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3train.preflight import validate_run  # noqa: E402
from k3train.runtime.bad_input import is_bad_input, report_bad_input  # noqa: E402


def overrides(name: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The command-line overrides of the ``name`` run (only ``optim.name`` and the run directory differ)."""
    return [f"--optim.name={name}", f"--train.steps={args.steps}", f"--train.out_dir={out / name}",
            "--checkpoint.resume=none", "--checkpoint.save_final=false", "--logging.wandb=false",
            *args.overrides]


def run(name: str, args: argparse.Namespace, out: Path) -> list[dict]:
    run_dir = out / name
    train = ["-m", "k3train.train", "--config", args.config, *overrides(name, args, out)]
    if args.nproc > 1:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={args.nproc}", *train]
    else:
        cmd = [sys.executable, *train]
    # lazy: torch (k3train.runtime.process_groups imports it) is not loaded for --help or a bad config
    from k3train.runtime.process_groups import child_pythonpath  # noqa: PLC0415
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=child_pythonpath(ROOT))
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--config", default="configs/small.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--out", default="runs/compare_optimizers")
    args, args.overrides = ap.parse_known_args()  # the rest: --section.key=value overrides (checked below)
    out = Path(args.out)
    for name in ("muon", "adamw"):  # both runs' configs, checked before either starts (each run checks again)
        try:
            validate_run(args.config, overrides(name, args, out), world_size=args.nproc)
        except Exception as e:
            if not is_bad_input(e):
                raise
            sys.exit(report_bad_input(e))
    res = {name: run(name, args, out) for name in ("muon", "adamw")}
    marks = sorted({1, max(1, args.steps // 4), max(1, args.steps // 2), args.steps})
    print(f"\nloss by step ({args.config}, {args.steps} steps, identical global batches)")
    print("step   " + "".join(f"{n:>10}" for n in res))
    for s in marks:
        print(f"{s:<7}" + "".join(f"{r[s - 1]['loss']:>10.4f}" for r in res.values()))
    tail = {n: sum(x["loss"] for x in r[-5:]) / len(r[-5:]) for n, r in res.items()}
    print("last5  " + "".join(f"{v:>10.4f}" for v in tail.values()))
    print(f"muon - adamw (mean of last 5 steps): {tail['muon'] - tail['adamw']:+.4f}")


if __name__ == "__main__":
    main()
