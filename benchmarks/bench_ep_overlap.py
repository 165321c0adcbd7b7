"""Benchmark the hiding of the expert all-to-all -- ``parallel.overlap_ep`` (F/B pairing, parallel/pairing.py) and
``parallel.expert_wgrad_split`` (the own experts' weight gradients while the input gradients travel,
moonep/dispatcher.py) -- and what of the gradient reduction and ZeRO's parameter broadcast stays exposed: time
through the real trainer step on gloo ranks (CPU), each setting after the other in one run.

    .venv/bin/python benchmarks/bench_ep_overlap.py                       # configs/small.yaml, dp2 ep2, 4 micro-batches
    .venv/bin/python benchmarks/bench_ep_overlap.py --world 4 --pp 2 --vpp 2   # pp2 vpp2 dp2 ep2 (4 ranks)
    .venv/bin/python benchmarks/bench_ep_overlap.py --config configs/tiny.yaml --steps 6 --micro-batches 6
    .venv/bin/python benchmarks/bench_ep_overlap.py --moonep false --recompute true --train.seq_len=128
    .venv/bin/python benchmarks/bench_ep_overlap.py --settings none,split --zero 2

Settings (``--settings``, comma-separated; default all four): ``none`` (neither: every collective waits in line,
the honest baseline), ``split`` (expert_wgrad_split only), ``paired`` (overlap_ep only), ``both``.

Every setting's trainer is built first and their steps run in turn (one step of each, round after round), so a
host whose speed drifts slows them alike. Per rank and setting (medians over the steps after ``--warmup``):
* ``a2a s0`` / ``a2a s1``: seconds per step this rank's EP dispatcher spent BLOCKED in token all-to-alls and the
  counts all-gather (the call, plus the wait of an async one), on side 0 (main thread: unpaired actions, paired
  backwards) and side 1 (pair worker: paired forwards). Off, everything is side 0 and fully exposed. On, side
  1's blocked time is hidden as far as the main thread computes meanwhile, side 0's as far as the worker does;
* ``grad``: seconds blocked waiting for the gradient reductions (``DistributedOptimizer``'s async per-chunk
  all-reduce / reduce to the owners, waited when the next chunk's are issued and before the norm): what of them
  the backward did not hide;
* ``bcast``: seconds of ZeRO's parameter broadcast after the update (zero >= 1; in line, all of it exposed);
* ``step``: ``Trainer.train_step`` seconds (the whole step: data, forward/backward, optimizer);
* ``hidden``: ``(step none - step X) / a2a none`` -- the share of the all-to-all time the setting took off the
  critical path (an estimate: pairing also overlaps compute with compute on a CPU with idle cores).

The results are identical either way (tests/integration/test_overlap_ep.py); only the time differs. Numbers
from a loaded or oversubscribed machine (fewer free cores than 2 x ranks) are not meaningful: give it an idle
machine. At pp > 1 the adjacent F/B computes of each rank's program are paired (p2p_programs.pair_programs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # shipped_data: the tests' private views of the shipped corpus

import moonep.dispatcher as d  # noqa: E402
from k3train.config import load_config  # noqa: E402
from k3train.optim import zero  # noqa: E402
from k3train.runtime.local_workers import run_ranks  # noqa: E402
from k3train.trainer import Trainer  # noqa: E402
from parallel.pairing import current_side  # noqa: E402
from shipped_data import shipped_view  # noqa: E402


class _Timed:
    """An async collective's work handle whose ``wait`` is timed into ``acc``."""

    def __init__(self, work: Any, acc: Any) -> None:
        self._work, self._acc = work, acc

    def wait(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait(*a, **kw)
        finally:
            self._acc(time.perf_counter() - t0)


SETTINGS = {"none": (False, False), "split": (False, True), "paired": (True, False), "both": (True, True)}


def _instrument() -> dict[Any, float]:
    """Time the dispatcher's all-to-alls and counts all-gathers per pairing side (keys 0, 1), the optimizer's
    waits for its gradient reductions (``"grad"``) and its parameter broadcast (``"bcast"``); returns the live
    totals."""
    totals: dict[int, float] = defaultdict(float)
    lock = threading.Lock()

    def add(dt: float, side: int) -> None:
        with lock:
            totals[side] += dt

    def wrap(fn: Any, handle_of: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            side = current_side()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            add(time.perf_counter() - t0, side)
            work = handle_of(out)
            if work is None:
                return out
            timed_work = _Timed(work, lambda dt: add(dt, side))
            return timed_work if out is work else (out[0], timed_work)
        return timed

    d.all_to_all_rows = wrap(d.all_to_all_rows, lambda out: out)
    d.all_gather_counts = wrap(d.all_gather_counts, lambda out: out[1])

    def timed_method(cls: Any, name: str, key: str) -> None:
        fn = getattr(cls, name)

        def timed(self: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                add(time.perf_counter() - t0, key)
        setattr(cls, name, timed)

    timed_method(zero._Pending, "finish", "grad")
    timed_method(zero.DistributedOptimizer, "_broadcast_params", "bcast")
    return totals


def _body(rank: int, world: int, args: argparse.Namespace) -> None:
    totals = _instrument()
    data = shipped_view("corpus_text_document")
    if data is None:
        raise SystemExit("the shipped corpus is not built: run `make data` (or `make test` once) first")
    trainers = {}
    for name in args.settings:  # every setting's trainer alive at once: their steps interleave (below)
        overlap, split = SETTINGS[name]
        out = Path(args.out) / name
        over = [f"--data.path={data}", "--data.split=100,0,0", f"--parallel.ep={args.ep}",
                f"--parallel.moonep={args.moonep}", f"--parallel.recompute={args.recompute}",
                f"--parallel.overlap_ep={str(overlap).lower()}", "--train.micro_batch_size=1",
                f"--parallel.expert_wgrad_split={str(split).lower()}", f"--parallel.zero={args.zero}",
                f"--train.global_batch_size={args.micro_batches * world // args.pp}", f"--parallel.pp={args.pp}",
                f"--parallel.vpp={args.vpp}",
                f"--train.steps={args.warmup + args.steps}", "--train.device=cpu", f"--train.out_dir={out}",
                "--logging.wandb=false", "--logging.peak_flops=1e9", "--logging.level=WARNING",
                "--checkpoint.resume=none", "--checkpoint.interval=0", "--checkpoint.save_final=false",
                *args.override]
        tr = Trainer(load_config(ROOT / args.config, over, world_size=world))
        assert (tr.pm.runner.pair is not None) == overlap, "overlap_ep did not take effect as asked"
        assert all(dp.split_wgrad == split for dp in tr.pm.ep_state.dispatchers.values()), "expert_wgrad_split"
        trainers[name] = tr
    # round-robin, one step of each setting in turn: a host whose speed drifts over minutes (a shared VM) slows
    # every setting alike instead of whichever ran last
    steps: dict[str, list[float]] = {n: [] for n in args.settings}
    seen: dict[str, list[dict]] = {n: [] for n in args.settings}
    for i in range(args.warmup + args.steps):
        for name in args.settings:
            totals.clear()
            t0 = time.perf_counter()
            trainers[name].train_step()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                steps[name].append(dt)
                seen[name].append(dict(totals))
    rows = {}
    for name, tr in trainers.items():
        tr.close(destroy_groups=False)
        rows[name] = (statistics.median(steps[name]), *(statistics.median(t.get(k, 0.0) for t in seen[name])
                                                        for k in (0, 1, "grad", "bcast")))
    every = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        print("rank 0 step seconds, in order: " + "; ".join(f"{n} " + " ".join(f"{t:.2f}" for t in steps[n])
                                                             for n in args.settings))
        print(f"{'rank':>4} {'setting':>7} {'step s':>8} {'a2a s0':>8} {'a2a s1':>8} {'grad s':>8} {'bcast s':>8} "
              f"{'hidden':>7}")
        for r, res in enumerate(every):
            base = res.get("none")
            for name in args.settings:
                step, s0, s1, grad, bcast = res[name]
                hidden = (f"{(base[0] - step) / (base[1] + base[2]):7.1%}"
                          if base is not None and name != "none" and base[1] + base[2] > 0 else "")
                print(f"{r:>4} {name:>7} {step:8.3f} {s0:8.3f} {s1:8.3f} {grad:8.3f} {bcast:8.3f} {hidden:>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/small.yaml")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (dp = world / pp)")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per rank per step")
    ap.add_argument("--moonep", default="true")
    ap.add_argument("--recompute", default="false")
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--settings", default="none,split,paired,both",
                    help="comma-separated, run in this order: none, split, paired, both (module docstring)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS)")
    args, args.override = ap.parse_known_args()  # the rest: --section.key=value overrides of the config
    args.settings = [x.strip() for x in args.settings.split(",") if x.strip()]
    bad = [x for x in args.settings if x not in SETTINGS]
    if bad or not args.settings:
        ap.error(f"--settings: unknown {bad} (choose from {', '.join(SETTINGS)})")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="k3train-bench-ep-overlap-") as tmp:
        os.environ.setdefault("K3TRAIN_TEST_DATA_VIEWS", str(Path(tmp) / "views"))
        args.out = tmp
        print(f"{args.config}: world {args.world}, pp {args.pp}, vpp {args.vpp}, ep {args.ep}, {args.micro_batches} "
              f"micro-batches per pipeline, moonep {args.moonep}, recompute {args.recompute}, zero {args.zero}; "
              f"{args.steps} steps after {args.warmup} warm-up; settings {', '.join(args.settings)}")
        run_ranks(_body, args.world, args, timeout=3000, threads=args.threads,
                  preload=("torch", "torch.distributed", "k3train.trainer"))


if __name__ == "__main__":
    main()
