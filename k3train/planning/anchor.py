"""The trainer anchor's run: the real trainer and the planner's isolated layer timing, measured in turns.

``python -m k3train.planning.anchor --config C --out FILE [--rounds R] [--threads N] [--section.key=v ...]``
(:func:`run_anchor` runs it in a fresh process and reads ``FILE``).

One process builds the real :class:`k3train.trainer.Trainer` for the overrides it is given (the planner passes one
process and one micro-batch per step, :func:`k3train.planning.layer_bench.anchor_overrides`), runs two warm-up
steps (the first allocates optimizer state), then ``R`` rounds of: the isolated per-layer timing of
:func:`k3train.planning.layer_bench.bench_layers` at the same ``[B, T]`` shape, then one real training step. A
round's ratio of the step's forward + backward to the isolated layers' sum is taken from two measurements seconds
apart, so a drift of the host's speed (this workplace's VMs drift by 2x within an hour: see README) cancels; the
anchor is the median over the rounds. ``FILE`` holds ``{"rounds": [{phases of the step, "isolated_fb_s"}, ...]}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROUNDS = 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k3train.planning.anchor")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--threads", type=int, default=1)
    args, overrides = ap.parse_known_args(argv)
    import tempfile

    import torch

    from k3train.config import load_config
    from k3train.planning.layer_bench import bench_layers
    from k3train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="k3anchor_") as tmp:
        fixed = [f"--train.out_dir={tmp}/run", "--checkpoint.resume=none", "--checkpoint.save_final=false",
                 "--checkpoint.interval=0", "--checkpoint.overwrite=true", "--logging.wandb=false",
                 "--logging.peak_flops=1e12", "--logging.level=WARNING", "--train.eval_interval=0",
                 f"--train.steps={2 + args.rounds}"]
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


def run_anchor(config: str, overrides: list[str], threads: int, timeout: float = 1800) -> dict[str, Any]:
    """Run :func:`main` in a fresh one-process job (``threads`` intra-op threads) and return its file."""
    import tempfile

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="k3anchor_") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update(WANDB_MODE="disabled", OMP_NUM_THREADS=str(threads), PYTHONPATH=str(root))
        cmd = [sys.executable, "-m", "k3train.planning.anchor", "--config", config, "--out", f"{tmp}/anchor.json",
               f"--threads={threads}", *overrides]
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"trainer anchor run failed (exit {p.returncode}): {' '.join(cmd)}\n"
                               f"{p.stderr[-3000:]}")
        return json.loads(Path(f"{tmp}/anchor.json").read_text())


if __name__ == "__main__":
    sys.exit(main())
