"""Measured peak of live tensor bytes per rank over real training steps (the ``--measure`` of tools/memory.py).

``torchrun --nproc_per_node=N -m k3train.planning.calibration.measure_memory --config C --out DIR [--steps K] [--section.key=v ...]``

Each rank builds the real :class:`k3train.trainer.Trainer` and runs ``K`` real optimizer steps (``train_step``:
loader, pipeline schedule, ZeRO reductions, MoonEP, KCP, all of it) under
:class:`~k3train.planning.fakerun.live_bytes.LiveBytes`, which books every tensor storage from the start of the process's
training code. The peak is taken from step 2 on (optimizer state exists from step 1's update; the start-up's
transients are not a training step's). On GPU ``torch.cuda.max_memory_allocated`` is recorded beside it. Each
rank writes ``DIR/rank{R}.json``: ``{rank, peak, peak_phase, phase_peak, cuda_max_allocated, timeline}`` (timeline: ``(action, live
bytes before, peak inside)`` of the last step's pipeline computes).

Nothing in the trainer is changed: the phases are labelled by wrapping the ParallelModel's ``forward_backward``
and the optimizer's ``step`` from outside.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

import torch

from k3train.config import load_config
from k3train.planning.fakerun.live_bytes import LiveBytes
from k3train.trainer import Trainer


def _labelled(lb: LiveBytes, name: str, fn):  # noqa: ANN001, ANN202 - a bound method
    def run(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        lb.set_phase(name)
        try:
            return fn(*a, **kw)
        finally:
            lb.set_phase("other")
    return run


def _timeline(lb: LiveBytes, runner, log: list) -> None:  # noqa: ANN001 - a PipelineRunner
    """Record ``(action, live before, peak inside)`` of every compute of the pipeline runner (diagnostics)."""
    for name in ("_forward", "_backward"):
        fn = getattr(runner, name, None)
        if fn is None:
            continue

        def run(a, _fn=fn):  # noqa: ANN001, ANN202
            if threading.current_thread() is not threading.main_thread():
                return _fn(a)  # a paired forward (F/B pairing's worker): the main thread's action records
            before, lb.phase_peak["action"] = lb.live, lb.live
            phase, lb.phase = lb.phase, "action"
            try:
                return _fn(a)
            finally:
                lb.phase = phase
                log.append((repr(a), before, lb.phase_peak["action"]))
        setattr(runner, name, run)


def _book_pair_worker(lb: LiveBytes, runner) -> None:  # noqa: ANN001 - a StepRunner
    """F/B pairing (``runner.pair``, parallel/pairing.py): book what the pair worker thread allocates too (the
    dispatch mode is thread-local: without this the paired forwards' activations are not counted)."""
    pair = getattr(runner, "pair", None)
    if pair is None:
        return
    run = pair.run

    def booked(fn):  # noqa: ANN001, ANN202
        def on_worker():  # noqa: ANN202
            with lb.on_this_thread():
                return fn()
        return on_worker

    pair.run = lambda worker_fn, main_fn, *a, **kw: run(booked(worker_fn), main_fn, *a, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k3train.planning.calibration.measure_memory")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    args, overrides = ap.parse_known_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(args.out)
    fixed = [f"--train.out_dir={out / 'run'}", "--checkpoint.resume=none", "--checkpoint.save_final=false",
             "--checkpoint.interval=0", "--checkpoint.overwrite=true", "--logging.wandb=false",
             "--logging.peak_flops=1e12", "--logging.level=WARNING"]
    cfg = load_config(args.config, overrides + fixed + [f"--train.steps={args.steps}"], world_size=world)
    lb = LiveBytes()
    with lb:
        trainer = Trainer(cfg)
        trainer.pm.forward_backward = _labelled(lb, "forward_backward", trainer.pm.forward_backward)
        trainer.optimizer.step = _labelled(lb, "optimizer_step", trainer.optimizer.step)
        timeline: list = []
        _timeline(lb, trainer.pm.runner, timeline)
        _book_pair_worker(lb, trainer.pm.runner)
        for s in range(args.steps):
            timeline.clear()
            if s == 1:
                lb.reset_peak()
            lb.set_phase("other")
            trainer.train_step()
        rec = {"rank": trainer.env.rank, "peak": lb.peak, "peak_phase": lb.peak_phase,
               "phase_peak": {k: v for k, v in lb.phase_peak.items() if k != "action"}, "timeline": timeline,
               "cuda_max_allocated": (torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None)}
        trainer.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rec['rank']}.json").write_text(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
