#!/usr/bin/env python
"""Checkpoint benchmark: how long a save blocks the training loop, synchronous vs ``checkpoint.async_save``.

For each process count in ``--nprocs`` (default 1 and 2) the script launches itself under ``torchrun``; every rank
builds the real trainer for ``--config`` (default configs/small.yaml: 94M parameters, model + Muon/AdamW state),
runs one training step (so optimizer state exists), then alternates ``--repeats`` times:

    sync   ``CheckpointManager.save`` with async_save=false: the loop is blocked for the whole write
    async  ``CheckpointManager.save`` with async_save=true (the staging copy), then one training step while DCP
           writes in the background, then ``wait()`` -- the stall is the save call PLUS whatever of the write
           was still left after that step (what the loop would wait for at the next save or at the end)

and reports the median stall of each (max over ranks), their ratio, the step time and the checkpoint size, all
measured in the same run. Every async checkpoint is verified against its manifest afterwards.

Example: ``.venv/bin/python benchmarks/bench_checkpoint.py --nprocs 1 2 [--section.key=value ...]``. A tool, not a test: timings on a shared
machine are noisy.
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

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3train.checkpoint import CheckpointManager  # noqa: E402
from k3train.checkpoint.manager import verify  # noqa: E402
from k3train.preflight import validate_run  # noqa: E402
from k3train.trainer import Trainer  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    out = Path(args.out)
    overrides = [f"--train.out_dir={out / 'run'}", "--checkpoint.resume=none", "--logging.wandb=false",
                 "--train.device=cpu", f"--train.seq_len={args.seq_len}", "--train.micro_batch_size=1",
                 f"--train.global_batch_size={args.gbs}", "--logging.peak_flops=1e12", *args.overrides]
    cfg = validate_run(args.config, overrides, int(os.environ.get("WORLD_SIZE", "1")))
    tr = Trainer(cfg)
    sync = CheckpointManager(out / "sync", keep=1, async_save=False)
    bg = CheckpointManager(out / "async", keep=1, async_save=True)
    step_s = [tr.train_step()["step_time_s"]]
    stalls: dict[str, list[float]] = {"sync": [], "async": [], "async_call": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        sync.save(tr.step, tr._tensor_state(), tr._rank_state())
        stalls["sync"].append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        bg.save(tr.step, tr._tensor_state(), tr._rank_state())
        call = time.perf_counter() - t0
        step_s.append(tr.train_step()["step_time_s"])  # training goes on while DCP writes
        t1 = time.perf_counter()
        done = bg.wait()
        stalls["async_call"].append(call)
        stalls["async"].append(call + time.perf_counter() - t1)
        assert verify(done) is None, f"async checkpoint {done} does not verify"
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {k: statistics.median(v) for k, v in stalls.items()}
    allr = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(allr, mine)
    else:
        allr = [mine]
    if rank == 0:
        latest = bg.latest()
        size = sum(f.stat().st_size for f in latest.iterdir())
        res = {k: max(r[k] for r in allr) for k in mine}
        res.update(world=world, step_s=statistics.median(step_s), bytes=size)
        print("BENCH " + json.dumps(res), flush=True)
    tr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/small.yaml")
    ap.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64, help="short sequences: the step is context, not the subject")
    ap.add_argument("--gbs", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args, args.overrides = ap.parse_known_args()  # the rest: --section.key=value overrides of the config
    if args.worker:
        worker(args)
        return
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    env.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for n in args.nprocs:
        with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
            cmd = [torchrun, "--standalone", f"--nproc_per_node={n}", __file__, "--worker", "--out", tmp,
                   "--config", args.config, "--repeats", str(args.repeats), "--seq-len", str(args.seq_len),
                   "--gbs", str(args.gbs), *args.overrides]
            res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("BENCH ")), None)
            if res.returncode != 0 or line is None:
                sys.exit(f"bench_checkpoint: {n} process(es) failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
            rows.append(json.loads(line[len("BENCH "):]))
    print(f"{args.config}: training-loop stall of one checkpoint save (median of {args.repeats}, max over ranks)")
    print(f"{'procs':>5} {'ckpt MiB':>9} {'step s':>7} {'sync s':>7} {'async call s':>13} {'async stall s':>14}"
          f" {'sync/async':>10}")
    for r in rows:
        print(f"{r['world']:>5} {r['bytes'] / 2**20:>9.0f} {r['step_s']:>7.2f} {r['sync']:>7.2f} "
              f"{r['async_call']:>13.2f} {r['async']:>14.2f} {r['sync'] / max(r['async'], 1e-9):>10.1f}x")
    print("async stall = the save call (staging copy) + what was left of the write after one training step")


if __name__ == "__main__":
    main()
