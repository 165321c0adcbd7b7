"""Benchmark the vision encoder's place in the pipeline (``parallel.encoder_schedule``): bubbles vs before vs inline.

    .venv/bin/python benchmarks/bench_vision_pipeline.py                                   # tiny-vl, pp = 2 and 4
    .venv/bin/python benchmarks/bench_vision_pipeline.py --pp 2 --steps 8 --vision.num_hidden_layers=4   # heavier ViT
    .venv/bin/python benchmarks/bench_vision_pipeline.py --pp 2 --steps 1 --warmup 0 --train.global_batch_size=4  # smoke

What runs: ``configs/tiny-vl.yaml`` (any ``--section.key=value`` overrides it) on the shipped multimodal corpus
(``make data-mm``), one pipeline of ``pp`` ranks (dp = cp = 1; gloo, local processes, one thread each) per
``--pp`` value. Every mode of ``--modes`` has its own runner (same weights); each step runs the modes one after
another (in a rotating order) on the same micro-batches (a different global batch per step, so the media vary),
after ``--warmup`` untimed steps. Give it an idle machine with at least ``max(pp)`` cores: ranks competing for a
core make every wait -- and so the bubble -- meaningless.

Reported per mode (medians over the timed steps):

* ``step ms``: measured step time of the pipeline (the slowest rank's ``forward_backward``, after a barrier);
* ``encoder ms``: total time of the encoder's actions (EF + EB on the first rank, the runner's ``encoder_s``);
* ``exposed ms`` / ``exposed %``: how much of that time the step pays. Definition (replay, so it is not swamped
  by timing noise between modes): every rank's measured action durations of the step (``runner.action_times``)
  are replayed through the schedule simulator (``schedules.simulate(..., durations=)``: each rank runs its
  actions in their order, each action starts when its rank is free and its p2p inputs exist, communication
  free) once as measured and once with the encoder actions' durations set to zero; exposed = the difference of
  the two makespans, ``exposed %`` = exposed / encoder time. ``before`` exposes about all of it (every encoder
  action lies on the first rank's path before / after the pipeline), ``bubbles`` only what the idle time and
  slack cannot hold. ``inline`` runs the encoder inside F(0, m) / B(0, m), so the replay cannot separate it:
  its columns read ``-`` (its cost shows in the step time);
* ``predicted %``: the same fraction from the static costs the placement uses (the partition's stage FLOPs, the
  media's vision FLOPs; ``PipelineRunner.encoder_costs``), for the step's micro-batches;
* ``replay ms``: the replayed makespan (measured computes, no communication) beside the measured step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3train.config import load_config  # noqa: E402
from k3train.data import GlobalBatchLoader  # noqa: E402
from k3train.runtime.local_workers import run_ranks  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.pipeline import LossNorm, build_step_runner  # noqa: E402
from parallel.pipeline.schedules import Action, build_schedule, place_encoder, simulate  # noqa: E402

MODES = ("bubbles", "before", "inline")


def _cfg(pp: int, mode: str, overrides: list[str]):
    return load_config(ROOT / "configs" / "tiny-vl.yaml",
                       [f"--parallel.pp={pp}", "--parallel.dp=1", "--train.device=cpu", *overrides,
                        f"--parallel.encoder_schedule={mode}"], world_size=pp)


def replay(actions: list[list[Action]], durations: list[list[float]], pp: int, vpp: int,
           zero_encoder: bool) -> float:
    """Makespan of the executed per-rank action lists with their measured durations (module docstring)."""
    durs = [[0.0 if zero_encoder and a.is_encoder else d for a, d in zip(acts, ds)]
            for acts, ds in zip(actions, durations)]
    return simulate(actions, pp, vpp, durations=durs).makespan


def predicted_fraction(runner, batches, mode: str) -> float:
    """Exposed / total encoder time under the placement's own static costs (module docstring)."""
    pp, vpp, M = runner.partition.pp, runner.partition.vpp, len(batches)
    f, b, ef, eb = runner.encoder_costs(batches)
    base = build_schedule(runner.schedule, pp, vpp, M, runner._paired_programs(False))  # the schedule it runs
    with_enc = simulate(place_encoder(base, pp, vpp, f, b, ef, eb, mode), pp, vpp, f, b, enc_f_cost=ef,
                        enc_b_cost=eb).makespan
    total = sum(ef) + sum(eb)
    return (with_enc - simulate(base, pp, vpp, f, b).makespan) / total if total else 0.0


def _rank_main(rank: int, world: int, modes: list[str], overrides: list[str], steps: int,
               warmup: int) -> tuple | None:
    """One gloo rank: every mode's step records (gathered from all ranks) returned by rank 0, with the partition's
    vpp, the micro-batch count and the schedule."""
    cfgs = {m: _cfg(world, m, overrides) for m in modes}
    cfg = cfgs[modes[0]]
    dims = ParallelDims.from_config(cfg.parallel, world, rank).build_groups()
    runners = {m: build_step_runner(None, cfgs[m], dims, num_microbatches=cfg.train.grad_accum_steps)
               for m in modes}
    loader = GlobalBatchLoader(cfg)
    mtp_w = cfg.model.mtp_loss_weight if cfg.model.num_nextn_predict_layers else 0.0
    records = []
    for step in range(warmup + steps):
        batches = loader.next_step()
        norm = LossNorm.from_batches(batches, mtp_w)
        per_mode = {}
        for m in modes[step % len(modes):] + modes[:step % len(modes)]:  # rotated: no mode always runs first
            run = runners[m]
            run.model.zero_grad(set_to_none=True)
            dist.barrier()
            st = run.forward_backward(batches, norm)
            per_mode[m] = {"step_s": st["step_s"], "encoder_s": st["encoder_s"], "loss": st["loss"],
                           "actions": [(a, dt) for a, dt in run.action_times]}
            if rank == 0 and m != "inline" and step >= warmup:
                per_mode[m]["predicted"] = predicted_fraction(run, batches, m)
        if step >= warmup:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, per_mode)
            records.append(gathered)
    if rank == 0:
        return records, runners[modes[0]].partition.vpp, cfg.train.grad_accum_steps, runners[modes[0]].schedule
    return None


def summarise(pp: int, records: list, vpp: int, M: int, schedule: str, modes: list[str]) -> None:
    print(f"pp={pp} vpp={vpp} M={M} ({schedule}), medians over {len(records)} steps")
    print(f"  {'mode':<8} {'step ms':>9} {'replay ms':>10} {'encoder ms':>11} {'exposed ms':>11} {'exposed %':>10} "
          f"{'predicted %':>12} {'loss':>10}")
    steps = {}
    for m in modes:
        rows = []
        for gathered in records:
            ranks = [g[m] for g in gathered]
            acts = [[a for a, _ in r["actions"]] for r in ranks]
            durs = [[d for _, d in r["actions"]] for r in ranks]
            enc = ranks[0]["encoder_s"]
            full = replay(acts, durs, pp, vpp, False)
            exposed = full - replay(acts, durs, pp, vpp, True) if m != "inline" else None
            rows.append((max(r["step_s"] for r in ranks), full, enc, exposed, ranks[0].get("predicted"),
                         sum(r["loss"] for r in ranks)))
        med = statistics.median
        step, full, enc = med(r[0] for r in rows), med(r[1] for r in rows), med(r[2] for r in rows)
        steps[m] = step
        if m == "inline":
            tail = f"{'-':>11} {'-':>11} {'-':>10} {'-':>12}"
        else:
            exp = med(r[3] for r in rows)
            frac = med(r[3] / r[2] if r[2] > 0 else 0.0 for r in rows)
            pred = med(r[4] for r in rows)
            tail = f"{1e3 * enc:>11.1f} {1e3 * exp:>11.1f} {100 * frac:>9.1f}% {100 * pred:>11.1f}%"
        print(f"  {m:<8} {1e3 * step:>9.1f} {1e3 * full:>10.1f} {tail} {rows[-1][5]:>10.5f}")
    if "bubbles" in steps and "before" in steps:
        print(f"  bubbles vs before: step time x{steps['bubbles'] / steps['before']:.3f}")
    losses = {round(sum(g[m]["loss"] for g in records[-1]), 6) for m in modes}
    if len(losses) > 1:
        print(f"  MISMATCH: the modes gave different losses {sorted(losses)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", default="2,4", help="comma-separated pipeline sizes (one pipeline of that many ranks)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated encoder schedules")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args, overrides = ap.parse_known_args()
    bad = [o for o in overrides if not (o.startswith("--") and "." in o.split("=", 1)[0])]
    if bad:
        ap.error(f"unknown arguments {bad} (config overrides are --section.key=value)")
    os.chdir(ROOT)  # the config's data and tokenizer paths are relative to the repository
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: each of {', '.join(MODES)}")
    if not Path(str(ROOT / "data_cache" / "mm") + ".bin").is_file() and not any(
            o.startswith("--data.path") for o in overrides):
        sys.exit("the shipped multimodal corpus is missing: run `make data-mm` (or pass --data.path=...)")
    for pp in (int(x) for x in args.pp.split(",")):
        _cfg(pp, modes[0], overrides)  # a bad override fails here, before any process starts
        records, vpp, M, schedule = run_ranks(_rank_main, pp, modes, overrides, args.steps, args.warmup,
                                              timeout=7200)[0]
        summarise(pp, records, vpp, M, schedule, modes)


if __name__ == "__main__":
    main()
