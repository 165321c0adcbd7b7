"""The trainer anchor's run: the real trainer and the planner's isolated layer timing, measured in turns.

``python -m k3train.planning.calibration.anchor_run --config C --out FILE [--rounds R] [--threads N] [--section.key=v
...]`` (:func:`k3train.planning.calibration.anchor.run_anchor` runs it in a fresh process and reads ``FILE``).

One process builds the real :class:`k3train.trainer.Trainer` for the overrides it is given (the planner passes one
process and one micro-batch per step, :func:`.layer_times.anchor_overrides`), runs two warm-up
steps (the first allocates optimizer state), then ``R`` rounds of: the isolated per-layer timing of
:func:`.layer_bench.bench_layers` at the same ``[B, T]`` shape, then one real training step. A
round's ratio of the step's forward + backward to the isolated layers' sum is taken from two measurements seconds
apart, so a drift of the host's speed (this workplace's VMs drift by 2x within an hour: see docs/benchmarks.md)
cancels; the anchor is the median over the rounds. ``FILE`` holds ``{"rounds": [{phases of the step, "isolated_fb_s"}, ...]}``.

``python -m k3train.planning.calibration.anchor_run --concurrency N --config C --out FILE ...``
(:func:`~k3train.planning.calibration.anchor.run_concurrency`) measures
how fast the same one-process trainer steps while ``n = 1..N`` copies of it step on this host at once, in lock-step
(each step of a phase ends at a barrier of the ``n`` active copies, as a synchronous data-parallel step waits for
its slowest rank). The copies are built once and kept; the phases ``n = 1..N`` repeat in rounds, and each round's
speeds are taken against its own ``n = 1`` phase seconds before, so the host's drift cancels. This, not a model
loop, is the workload because the trainer's step (its data loader, optimizer, per-step bookkeeping and working
set) is what the ranks of a run share the cores with: on a 2-core host four such copies each ran at 0.41 of one
alone, where four copies of the bare model's forward + backward ran at 0.47-0.61.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from k3train.config import load_config
from k3train.planning.calibration.layer_bench import bench_layers
from k3train.runtime.process_groups import cores_available
from k3train.trainer import Trainer

ROUNDS = 3
_FIXED = ["--checkpoint.resume=none", "--checkpoint.save_final=false", "--checkpoint.interval=0",
          "--checkpoint.overwrite=true", "--logging.wandb=false", "--logging.peak_flops=1e12",
          "--logging.level=WARNING", "--train.eval_interval=0"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k3train.planning.calibration.anchor_run")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=0, metavar="N")
    ap.add_argument("--steps", type=int, default=3, help="with --concurrency: lock-step steps per phase")
    args, overrides = ap.parse_known_args(argv)
    if args.concurrency:
        curve = concurrency_curve(args.config, overrides, args.concurrency, args.threads, args.rounds, args.steps)
        Path(args.out).write_text(json.dumps(curve))
        return 0
    with tempfile.TemporaryDirectory(prefix="k3anchor_") as tmp:
        fixed = [f"--train.out_dir={tmp}/run", *_FIXED, f"--train.steps={2 + args.rounds}"]
        cfg = load_config(args.config, overrides + fixed, world_size=1)
        torch.set_num_threads(args.threads)
        trainer = Trainer(cfg)
        B, T = cfg.train.micro_batch_size, cfg.train.seq_len
        trainer.train_step()
        trainer.train_step()
        rounds: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            t = bench_layers(cfg, B, T, 1, args.threads)
            iso = sum(x[0] + x[1] for x in [t["embed"], *t["layers"], t["head"]])
            torch.set_num_threads(args.threads)
            rec = trainer.train_step()
            rounds.append({k: rec[k] for k in ("step_time_s", "time_forward_backward_s", "time_grad_norm_s",
                                               "time_optimizer_s")} | {"isolated_fb_s": iso})
        trainer.close()
    Path(args.out).write_text(json.dumps({"B": B, "T": T, "rounds": rounds}))
    return 0


def _concurrency_worker(idx: int, config: str, overrides: list[str], threads: int, max_rounds: int, steps: int,
                        procs: int, budget_s: float, build_lock: Any, barriers: list[Any], rounds_v: Any, out: Any,
                        tmp: str) -> None:
    """Copy ``idx`` of :func:`concurrency_curve`: build the trainer (one copy at a time: the dataset's index cache
    is built once), warm up, then per round and phase ``n`` step ``steps`` times in lock-step if ``idx < n``.
    Copy 0 times one step alone after the warm-up and sets the rounds (at most ``max_rounds``, at least 2) that fit
    ``budget_s`` under processor sharing. ``out[(round * procs + n - 1) * procs + idx]``: the phase's seconds per
    step on this copy."""
    total = 3 + max_rounds * steps * procs
    with build_lock:
        cfg = load_config(config, overrides + [f"--train.out_dir={tmp}/run{idx}", *_FIXED,
                                               f"--train.steps={total}"], world_size=1)
        torch.set_num_threads(threads)
        trainer = Trainer(cfg)
    torch.set_num_threads(threads)
    trainer.train_step()  # optimizer state allocated
    trainer.train_step()
    everyone = barriers[procs - 1]
    everyone.wait()
    if idx == 0:
        t0 = time.perf_counter()
        trainer.train_step()
        alone = time.perf_counter() - t0
        cores = cores_available()
        per_round = steps * alone * sum(max(1.0, n * threads / cores) for n in range(1, procs + 1))
        rounds_v.value = max(min(2, max_rounds), min(max_rounds, int(budget_s / max(1e-9, per_round))))
    everyone.wait()
    for rnd in range(rounds_v.value):
        for n in range(1, procs + 1):
            everyone.wait()
            if idx >= n:
                continue
            t0 = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
                barriers[n - 1].wait()
            out[(rnd * procs + n - 1) * procs + idx] = (time.perf_counter() - t0) / steps
    everyone.wait()
    trainer.close()


def concurrency_curve(config: str, overrides: list[str], procs: int, threads: int, rounds: int = ROUNDS,
                      steps: int = 3, budget_s: float = 150.0) -> dict[str, float]:
    """``{n: speed}`` for ``n = 1..procs``: seconds per lock-step step of one copy alone over those of ``n`` copies
    at once, the median over the rounds of each round's own ratio, made monotone (more copies never run faster).
    ``rounds`` is a maximum: a config whose step is long gets as many (>= 2) as fit ``budget_s``."""
    ctx = multiprocessing.get_context("spawn")
    barriers = [ctx.Barrier(n) for n in range(1, procs + 1)]
    out = ctx.Array("d", rounds * procs * procs)
    rounds_v = ctx.Value("i", rounds)
    lock = ctx.Lock()
    with tempfile.TemporaryDirectory(prefix="k3conc_") as tmp:
        ps = [ctx.Process(target=_concurrency_worker, args=(i, config, overrides, threads, rounds, steps, procs,
                                                            budget_s, lock, barriers, rounds_v, out, tmp))
              for i in range(procs)]
        for p in ps:
            p.start()
        failed = False
        while any(p.is_alive() for p in ps):  # a copy that fails breaks the barriers, so no other copy waits forever
            if not failed and any(p.exitcode not in (None, 0) for p in ps):
                failed = True
                for b in barriers:
                    b.abort()
            next(p for p in ps if p.is_alive()).join(timeout=0.5)
        if failed or any(p.exitcode != 0 for p in ps):
            raise RuntimeError("trainer concurrency calibration: a copy of the trainer failed")
    done = rounds_v.value
    per = [[max(out[(r * procs + n - 1) * procs:(r * procs + n - 1) * procs + n]) for n in range(1, procs + 1)]
           for r in range(done)]
    curve, best = {}, 1.0
    for n in range(1, procs + 1):
        ratios = sorted(per[r][0] / per[r][n - 1] for r in range(done))
        best = min(best, ratios[len(ratios) // 2])
        curve[str(n)] = best
    return curve


if __name__ == "__main__":
    sys.exit(main())
