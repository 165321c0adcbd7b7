"""Benchmark the pipeline: AttnRes p2p bytes (cached vs full) and the schedule's idle fraction.

    .venv/bin/python benchmarks/bench_pipeline.py                    # analytic K3 tables + gloo runs (4 ranks)
    .venv/bin/python benchmarks/bench_pipeline.py --no-run           # analytic only
    .venv/bin/python benchmarks/bench_pipeline.py --steps 3 --micro-batches 8
    .venv/bin/python benchmarks/bench_pipeline.py --recv-waits --steps 20        # Part 3 only (receive waits)

Part 1 (analytic, full K3 dims: 93 layers, AttnRes blocks of 12, H = 7168, S = 8192 tokens per micro-batch,
bf16): bytes per micro-batch per boundary and per step for the proposed layouts (auto partition from the cost
model), cached vs full, and the theoretical bubble ``(pp-1)/(vpp*M+pp-1)``.

Part 2 (measured, gloo on this CPU): a config with K3's block geometry scaled down -- 24 layers in blocks of 3
(8 blocks, as K3's 93 layers in blocks of 12), KDA:MLA 3:1, LatentMoE, MTP -- at pp = 4: measured bytes per step
(all ranks, cached vs full; equal to the analytic plan), step time and idle fraction ``1 - compute/step`` per
rank for vpp = 1 vs vpp = 2 next to the theoretical bubble. On a shared, oversubscribed CPU the ranks compete for
cores, so the measured idle fraction is indicative only.

Part 1 also shows the partitioner's AttnRes tie-break at pp=8 vpp=4 (bytes per micro-batch of the plain
min-bottleneck split vs the auto partition, same bottleneck) and, per schedule, how many receives the p2p programs
post at least one compute ahead of their consumer (time-ordered posts vs posted ahead).

Part 3 (``--recv-waits``, measured, gloo): configs/tiny.yaml at pp=2 vpp=2 and pp=4 vpp=2, one pipeline,
the time each rank spends blocked waiting for receives per step (``recv_wait_s``: median over ``--steps``) with
the time-ordered posts and with receives posted one compute ahead (``--post-ahead both|on|off``). Give it an idle
machine with at least pp cores: on an oversubscribed CPU a wait mostly measures the scheduler.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3train.config import load_config  # noqa: E402
from k3train.config.presets import tiny_config  # noqa: E402
from k3train.data.batch import Batch  # noqa: E402
from k3train.model.model import K3Model  # noqa: E402
from k3train.runtime.local_workers import run_ranks  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.pipeline import (AttnResCommPlan, LossNorm, build_partition, build_step_runner,  # noqa: E402
                               describe_partition, theoretical_bubble)
from parallel.pipeline.p2p import build_programs, recv_lead  # noqa: E402
from parallel.pipeline.placement import Placement  # noqa: E402
from parallel.pipeline.partition import (auto_layers_per_stage, embed_cost, head_cost,  # noqa: E402
                                         layer_cost)
from parallel.pipeline.schedules import build_schedule, resolve_schedule, simulate  # noqa: E402

GB = 1e9


def _k3_cfg(pp: int, vpp: int, *extra: str):
    return load_config(None, ["--model.num_nextn_predict_layers=1", f"--parallel.pp={pp}", f"--parallel.vpp={vpp}",
                              "--train.seq_len=8192", *extra])


def boundary_table(plan: AttnResCommPlan, per_tensor: float) -> list[str]:
    """One line per boundary: cut layer, tensors sent forward (full vs cached), bytes per micro-batch."""
    full = AttnResCommPlan(plan.part, "full")
    unit, div = ("MB", 1e6) if per_tensor >= 1e6 else ("KB", 1e3)
    lines = [f"  {'b':>3} {'cut':>4} {'ranks':>7}   full: {'p':>1}+{'blk':<3} {unit + '/mb':>8}   "
             f"cached: {'p':>1}+{'blk':<3} {unit + '/mb':>8}"]
    for b in range(plan.part.num_stages - 1):
        cut = plan.part.bounds[b][1]
        f, c = full.payload(b), plan.payload(b)
        src, dst = plan.part.placement.boundary_ranks(b)
        lines.append(f"  {b:>3} {cut:>4} {src:>3}->{dst:<3}   "
                     f"{int(f.partial):>7}+{len(f.blocks):<3} {len(f) * per_tensor / div:>8.1f}   "
                     f"{int(c.partial):>9}+{len(c.blocks):<3} {len(c) * per_tensor / div:>8.1f}")
    return lines


def analytic_k3(layouts: list[tuple[int, int, int]], show_table: tuple[int, int]) -> None:
    S, elem = 8192, 2
    print("=" * 100)
    print("Part 1: full K3 (93 layers, blocks of 12, H=7168), S=8192 tokens per micro-batch, bf16 on the wire")
    print("=" * 100)
    rows = []
    for pp, vpp, M in layouts:
        cfg = _k3_cfg(pp, vpp)
        part = build_partition(cfg.model, cfg.parallel, S)
        per = S * cfg.model.hidden_size * elem
        cached, full = AttnResCommPlan(part, "cached"), AttnResCommPlan(part, "full")
        c = cached.step_bytes(M, S, cfg.model.hidden_size, elem)
        f = full.step_bytes(M, S, cfg.model.hidden_size, elem)
        sched = build_schedule(resolve_schedule("auto", pp, vpp), pp, vpp, M)
        costs = part.stage_costs
        sim = simulate(sched, pp, vpp, f_cost=[x / max(costs) for x in costs],
                       b_cost=[2 * x / max(costs) for x in costs])
        rows.append((pp, vpp, M, part.layers_per_stage(), f["total"] / GB, c["total"] / GB, 1 - c["total"] / f["total"],
                     theoretical_bubble(pp, vpp, M), sim.bubble))
        if (pp, vpp) == show_table:
            print(describe_partition(part))
            print(f"\nper boundary, one micro-batch, forward only (gradients add the same again); one tensor "
                  f"= S*H*2 B = {per / 1e6:.1f} MB")
            print("\n".join(boundary_table(cached, per)))
            print()
    print(f"{'pp':>3} {'vpp':>3} {'M':>4} {'full GB/step':>13} {'cached GB/step':>15} {'saved':>6} "
          f"{'bubble formula':>15} {'bubble sim*':>12}   layers per virtual stage")
    for pp, vpp, M, sizes, fg, cg, saved, th, sb in rows:
        print(f"{pp:>3} {vpp:>3} {M:>4} {fg:>13.1f} {cg:>15.1f} {100 * saved:>5.1f}% {th:>15.3f} {sb:>12.3f}   "
              f"{sizes}")
    print("  GB/step: one pipeline (all its boundaries, activations + gradients), M micro-batches of S tokens.")
    print("  *bubble sim: the schedule simulated with the cost model's per-stage costs (backward = 2 x forward).")


def tie_break_k3(pp: int = 8, vpp: int = 4, S: int = 8192) -> None:
    """AttnRes bytes per micro-batch (one direction; gradients add the same again) of the plain min-bottleneck
    split vs the auto partition (same bottleneck, cuts moved onto block boundaries)."""
    cfg = _k3_cfg(pp, vpp)
    m = cfg.model
    auto = build_partition(m, cfg.parallel, S)
    plain_sizes = auto_layers_per_stage([layer_cost(m, i, S) for i in range(m.num_hidden_layers)], pp * vpp,
                                        embed_cost(m), head_cost(m, S))
    plain_cfg = _k3_cfg(pp, vpp, f"--parallel.pp_layers=[{','.join(map(str, plain_sizes))}]")
    plain = build_partition(plain_cfg.model, plain_cfg.parallel, S)
    print(f"\nAttnRes tie-break, K3 pp={pp} vpp={vpp}, S={S}, bf16, cached (MiB per micro-batch, forward):")
    for name, part in (("plain min-bottleneck split", plain), ("auto partition (tie-break)", auto)):
        b = AttnResCommPlan(part, "cached").step_bytes(1, S, m.hidden_size, 2)
        mid = sum(1 for s_, _ in part.bounds[1:] if s_ % part.block_size)
        print(f"  {name:<28} {b['grad'] / 2**20:>8.0f} MiB  (partial {b['hidden'] / 2**20:.0f} + blocks "
              f"{b['block_cache'] / 2**20:.0f}; {mid} of {part.num_stages - 1} cuts inside a block; bottleneck "
              f"{max(part.stage_costs) / 1e9:.4f} GFLOP/tok)  {part.layers_per_stage()}")


def recv_lead_table(layouts: list[tuple[str, int, int, int]]) -> None:
    """Receives posted at least one compute before their consumer, time-ordered vs posted ahead."""
    print("\nreceives posted >= 1 compute ahead of their consumer (of those not consumed by a rank's first compute)")
    print(f"  {'schedule':<12} {'pp':>3} {'vpp':>3} {'M':>4} {'time-ordered':>13} {'posted ahead':>13}")
    for kind, pp, vpp, M in layouts:
        sched = build_schedule(kind, pp, vpp, M)
        sim = simulate(sched, pp, vpp)
        out = []
        for ahead in (False, True):
            a, n = recv_lead(build_programs(sched, pp, vpp, sim, post_ahead=ahead), pp, vpp)
            out.append(f"{a}/{n} {100 * a / n:3.0f}%")
        print(f"  {kind:<12} {pp:>3} {vpp:>3} {M:>4} {out[0]:>13} {out[1]:>13}")


# --------------------------------------------------------------------------------------------------------------
# measured (gloo)
# --------------------------------------------------------------------------------------------------------------
def _small_cfg(pp: int, vpp: int, comm: str, M: int, hidden: int, seq: int):
    """24 layers in blocks of 3, split evenly (24 / (pp*vpp) layers per virtual stage)."""
    n = pp * vpp
    return tiny_config(f"--parallel.pp_layers=[{','.join([str(24 // n)] * n)}]",
                       f"--model.hidden_size={hidden}", "--model.vocab_size=512", "--model.num_hidden_layers=24",
                       "--model.attn_res_block_size=3", "--model.num_experts=4", "--model.num_experts_per_token=2",
                       "--model.kda_chunk_size=16", f"--parallel.pp={pp}", f"--parallel.vpp={vpp}",
                       f"--parallel.attnres_comm={comm}", f"--train.seq_len={seq}", "--train.micro_batch_size=1",
                       f"--train.global_batch_size={M}", world_size=pp)


def _timed_steps(runner, batches: list[Batch], norm: LossNorm, steps: int) -> list[dict]:
    """One warm-up step, then ``steps`` timed ones (the ranks start each together): their step statistics."""
    runner.forward_backward(batches, norm)  # warm-up
    recs = []
    for _ in range(steps):
        runner.model.zero_grad(set_to_none=True)
        dist.barrier()
        recs.append(runner.forward_backward(batches, norm))
    return recs


def _measure_rank(rank: int, world: int, runs: list, steps: int, hidden: int, seq: int) -> list | None:
    """One gloo rank of :func:`measured`: every rank's best step per run, gathered on rank 0 (which returns them)."""
    out = []
    for vpp, comm, M in runs:
        cfg = _small_cfg(world, vpp, comm, M, hidden, seq)
        dims = ParallelDims.from_config(cfg.parallel, world, rank).build_groups()
        model = K3Model(cfg.model)
        model.init_weights(1)
        runner = build_step_runner(model, cfg, dims, num_microbatches=M)
        g = torch.Generator().manual_seed(0)
        batches = [Batch.from_samples(torch.randint(3, 512, (1, seq + 1), generator=g), eos_id=1) for _ in range(M)]
        norm = LossNorm.from_batches(batches, cfg.model.mtp_loss_weight)
        best = min(_timed_steps(runner, batches, norm, steps), key=lambda s: s["step_s"])
        mine = {k: best[k] for k in ("step_s", "compute_s", "p2p_bytes", "p2p_bytes_hidden", "p2p_bytes_block_cache",
                                     "p2p_bytes_grad")}
        # mean forward / backward seconds per local chunk (last step), for the simulated bubble
        for kind in "FB":
            for c in range(vpp):
                ts = [t for a, t in runner.action_times if a.kind == kind and a.chunk == c]
                mine[f"{kind}{c}"] = sum(ts) / len(ts)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            tokens = seq
            plan = runner.plan.step_bytes(M, tokens, hidden, 4)
            out.append(((vpp, comm, M), gathered, plan, runner.partition.layers_per_stage()))
    return out if rank == 0 else None


def measured(pp: int, M: int, steps: int, hidden: int, seq: int) -> None:
    print("=" * 100)
    print(f"Part 2: measured with gloo, {pp} ranks: 24 layers in AttnRes blocks of 3, hidden {hidden}, "
          f"{seq} tokens per micro-batch, fp32, M = {M}")
    print("=" * 100)
    runs = [(1, "cached", M), (2, "full", M), (2, "cached", M)]
    out = run_ranks(_measure_rank, pp, runs, steps, hidden, seq, timeout=3600)[0]
    print(f"{'vpp':>3} {'comm':>6} {'layers/stage':<26} {'sent MB/step':>12} {'hidden':>8} {'blocks':>8} "
          f"{'grad':>8} {'= plan':>6} {'step s':>7} {'idle (1-compute/step) per rank':>32} {'sim@meas':>9} "
          f"{'formula':>10}")
    for (vpp, comm, M_), per_rank, plan, sizes in out:
        tot = {k: sum(r[k] for r in per_rank) for k in per_rank[0]}
        step = max(r["step_s"] for r in per_rank)
        idle = " ".join(f"{1 - r['compute_s'] / r['step_s']:.2f}" for r in per_rank)
        # the schedule simulated with the measured per-stage forward/backward times
        pl = Placement.of(pp, vpp)
        f = [per_rank[pl.rank_of(v)][f"F{pl.chunk_of(v)}"] for v in range(pp * vpp)]
        b = [per_rank[pl.rank_of(v)][f"B{pl.chunk_of(v)}"] for v in range(pp * vpp)]
        sim = simulate(build_schedule(resolve_schedule("auto", pp, vpp), pp, vpp, M_), pp, vpp, f, b)
        ok = "yes" if tot["p2p_bytes"] == plan["total"] else "NO"
        print(f"{vpp:>3} {comm:>6} {str(sizes):<26} {tot['p2p_bytes'] / 1e6:>12.3f} "
              f"{tot['p2p_bytes_hidden'] / 1e6:>8.3f} {tot['p2p_bytes_block_cache'] / 1e6:>8.3f} "
              f"{tot['p2p_bytes_grad'] / 1e6:>8.3f} {ok:>6} {step:>7.2f} {idle:>32} "
              f"{sim.bubble:>9.3f} {theoretical_bubble(pp, vpp, M_):>10.3f}")
    full = next(t for (v, c, _), t, _, _ in out if v == 2 and c == "full")
    cached = next(t for (v, c, _), t, _, _ in out if v == 2 and c == "cached")
    f, c = sum(r["p2p_bytes"] for r in full), sum(r["p2p_bytes"] for r in cached)
    print(f"vpp=2: cached/full bytes = {c / f:.3f} ({100 * (1 - c / f):.1f}% saved)")
    print("idle: measured per rank (ranks share this machine's cores, so a waiting rank's core is used by another and"
          " the measured idle understates the bubble); sim@meas: the schedule simulated with the measured mean"
          " forward/backward time of every virtual stage; formula: (pp-1)/(vpp*M+pp-1).")


# --------------------------------------------------------------------------------------------------------------
# Part 3: receive waits, configs/tiny.yaml (gloo)
# --------------------------------------------------------------------------------------------------------------
def _waits_rank(rank: int, world: int, vpp: int, modes: list[bool], steps: int) -> tuple[int, list] | None:
    """One gloo rank of :func:`recv_waits`: per post order, every rank's median waits, gathered on rank 0 (which
    returns them with the micro-batch count)."""
    cfg = tiny_config(f"--parallel.pp={world}", f"--parallel.vpp={vpp}", world_size=world)
    M, B, T = cfg.train.grad_accum_steps, cfg.train.micro_batch_size, cfg.train.seq_len
    g = torch.Generator().manual_seed(0)
    batches = [Batch.from_samples(torch.randint(3, cfg.model.vocab_size, (B, T + 1), generator=g),
                                  eos_id=cfg.model.eos_token_id) for _ in range(M)]
    norm = LossNorm.from_batches(batches, cfg.model.mtp_loss_weight)
    dims = ParallelDims.from_config(cfg.parallel, world, rank).build_groups()
    out = {}
    for ahead in modes:
        model = K3Model(cfg.model)
        model.init_weights(1)
        runner = build_step_runner(model, cfg, dims, num_microbatches=M, post_ahead=ahead)
        stats = _timed_steps(runner, batches, norm, steps)
        med = [sorted(x)[len(x) // 2] for x in zip(*((st["recv_wait_s"], st["step_s"], st["compute_s"])
                                                      for st in stats))]
        _, prog, _ = runner.program(M)
        n_recv = sum(1 for ins in prog if ins.op == "recv")
        out[ahead] = (*med, n_recv, stats[-1]["loss"])
    gathered: list = [None] * world
    dist.all_gather_object(gathered, out)
    return (M, gathered) if rank == 0 else None


def recv_waits(layouts: list[tuple[int, int]], modes: list[bool], steps: int) -> None:
    print("=" * 100)
    print(f"Part 3: time blocked on p2p receives per step, configs/tiny.yaml, gloo, medians of {steps} steps")
    print("=" * 100)
    for pp, vpp in layouts:
        M, per_rank = run_ranks(_waits_rank, pp, vpp, modes, steps, timeout=3600)[0]
        print(f"pp={pp} vpp={vpp} M={M} ({resolve_schedule('auto', pp, vpp)}):")
        print(f"  {'posts':<13} {'recv wait ms per rank':<40} {'sum':>8} {'step ms (max)':>14} {'loss':>10}")
        for ahead in modes:
            waits = [r[ahead][0] * 1e3 for r in per_rank]
            step = max(r[ahead][1] for r in per_rank) * 1e3
            loss = sum(r[ahead][4] for r in per_rank)
            print(f"  {'posted ahead' if ahead else 'time-ordered':<13} "
                  f"{' '.join(f'{w:7.1f}' for w in waits):<40} {sum(waits):>8.1f} {step:>14.1f} {loss:>10.5f}")
        losses = {sum(r[ahead][4] for r in per_rank) for ahead in modes}
        if len(losses) > 1:
            print(f"  MISMATCH: the two post orders gave different losses {sorted(losses)}")
    print("  recv wait: seconds inside P2PTransport.wait (data not there yet); the loss (summed over ranks) must be"
          " identical in both modes.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-run", action="store_true", help="analytic part only")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--recv-waits", action="store_true",
                    help="only Part 3: receive waits of configs/tiny.yaml at pp=2 vpp=2 and pp=4 vpp=2")
    ap.add_argument("--post-ahead", choices=("both", "on", "off"), default="both",
                    help="Part 3: receives posted one compute ahead (on), time-ordered (off), or both")
    ap.add_argument("--layouts", default="2x2,4x2", help="Part 3: comma-separated PPxVPP layouts")
    args = ap.parse_args()
    if args.recv_waits:
        modes = {"both": [False, True], "on": [True], "off": [False]}[args.post_ahead]
        layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
        recv_waits(layouts, modes, args.steps)
        return
    # K3 layouts: (pp, vpp, micro-batches per pipeline per step)
    layouts = [(8, 1, 32), (8, 2, 32), (8, 3, 32), (16, 1, 32), (16, 2, 32), (12, 2, 24)]
    analytic_k3(layouts, show_table=(8, 2))
    tie_break_k3(8, 4)
    recv_lead_table([("1f1b", 4, 1, 8), ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 4),
                     ("interleaved", 8, 4, 32), ("afab", 4, 2, 8)])
    small = _small_cfg(4, 2, "cached", 8, args.hidden, args.seq)
    part = build_partition(small.model, small.parallel, args.seq)
    plan = AttnResCommPlan(part, "cached")
    print("\nscaled-down geometry (24 layers, blocks of 3, pp=4, vpp=2):")
    print(describe_partition(part))
    print("\n".join(boundary_table(plan, args.seq * args.hidden * 4)))
    if not args.no_run:
        measured(args.pp, args.micro_batches, args.steps, args.hidden, args.seq)


if __name__ == "__main__":
    main()
