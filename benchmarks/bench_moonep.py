"""Benchmark MoonEP: per-rank load balance of the planner on skewed routing, next to plain EP and EPLB-style static
replication; the planning + layout time per layer; MoonEP's extra memory vs depth and micro-batches in flight;
the MoE layer step time on real gloo ranks.

    python benchmarks/bench_moonep.py planner         # load max/mean, replicas, bytes: E=64/R=8/top-8, K3 E=896/R=64/top-16
    python benchmarks/bench_moonep.py layout          # plan + layout ms per layer and micro-batch at K3 scale (E=896, R=64)
    python benchmarks/bench_moonep.py memory          # MoonEP extra bytes per rank vs MoE layers x micro-batches in flight
    python benchmarks/bench_moonep.py step --world 2     # fwd+bwd time of a small MoE layer, MoonEP on vs off

Routing model: Zipf(alpha) expert popularity (popularity ranks randomly placed over experts), each token picks k
distinct experts with probability proportional to popularity. EPLB baseline (DeepSeek's static redundancy,
fixed for the step): from the PREVIOUS batch's counts, give the hottest experts ``E/R`` extra copies per rank in
total (largest load-per-copy first), pack the copies onto ranks (``2E/R`` slots each, heaviest copy to the
lightest rank with a free slot), split every expert's tokens evenly over its copies; evaluated on the current batch.
Byte counts assume bf16 weights and activations.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import timeit
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from k3train.config import ModelConfig  # noqa: E402
from k3train.model.moe import LatentMoE  # noqa: E402
from k3train.planning.fakerun.live_bytes import LiveBytes  # noqa: E402
from k3train.runtime.local_workers import run_ranks  # noqa: E402
from moonep import apply_expert_parallel, collect_moonep_metrics  # noqa: E402
from moonep.fast_layout import counts_to_host, fast_rank_layout, plan_with_takes  # noqa: E402
from moonep.layout import build_rank_layout, local_route_positions  # noqa: E402
from moonep.planner import max_over_mean, plan_redundant_experts, zipf_counts  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402


def eplb_loads(history: np.ndarray, current: np.ndarray, R: int) -> np.ndarray:
    """Per-rank loads of an EPLB-style static placement built from ``history``, evaluated on ``current``."""
    E = history.size
    n = E // R
    copies = np.ones(E, dtype=np.int64)
    hist = history.astype(np.float64) + 1e-9
    for _ in range(R * n):  # redundancy budget: E/R extra slots per rank
        copies[int(np.argmax(hist / copies))] += 1
    items = sorted(((hist[e] / copies[e], e) for e in range(E) for _ in range(copies[e])), reverse=True)
    load_hist = np.zeros(R)
    free = np.full(R, 2 * n)
    placed = np.zeros((E, R))
    for w, e in items:
        cand = np.flatnonzero(free > 0)
        r = int(cand[np.argmin(load_hist[cand])])
        load_hist[r] += w
        free[r] -= 1
        placed[e, r] += 1
    return (placed / copies[:, None] * current[:, None]).sum(0)


def _drift(perm: np.ndarray, frac: float, rng: np.random.Generator) -> np.ndarray:
    """Re-shuffle the popularity positions of a fraction ``frac`` of the experts (routing drift)."""
    perm = perm.copy()
    moved = rng.choice(perm.size, int(round(frac * perm.size)), replace=False)
    perm[moved] = perm[rng.permutation(moved)]
    return perm


def bench_planner(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    # (E, R, k, tokens per rank, l, bytes per expert (3 matrices, bf16)); E=64 uses DeepSeek-V2-Lite-like dims
    setups = [(64, 8, 8, args.tokens, 2048, 3 * 2048 * 1408 * 2),
              (896, 64, 16, args.tokens, 3584, 3 * 3584 * 3072 * 2)]
    print(f"per-rank routed-token load max/mean (1.00 = perfect); mean over {args.trials} micro-batches of "
          f"{args.tokens} tokens/rank; drift = fraction of experts whose popularity moves between micro-batches")
    print(f"{'E':>4} {'R':>3} {'k':>3} {'alpha':>5} {'drift':>5} | {'plain EP':>8} {'EPLB':>6} {'MoonEP':>6} | "
          f"{'repl/rank max':>13} {'repl total':>10} {'LB':>3} | {'weight MB/layer':>15} {'token MB/layer':>14}")
    for E, R, k, tokens, l_dim, expert_bytes in setups:
        for alpha in args.alphas:
            for drift in args.drifts:
                plain, eplb, moon, rmax, rtot, wbytes = [], [], [], [], [], []
                perm = rng.permutation(E)
                history = zipf_counts(E, tokens * R, k, alpha, rng, permute=False)[perm]
                for _ in range(args.trials):
                    perm = _drift(perm, drift, rng)
                    c = zipf_counts(E, tokens * R, k, alpha, rng, permute=False)[perm]
                    plan = plan_redundant_experts(c, R)
                    plain.append(max_over_mean(plan.loads_before))
                    moon.append(max_over_mean(plan.loads_after))
                    eplb.append(max_over_mean(eplb_loads(history, c, R)))
                    rmax.append(plan.num_replicas.max())
                    rtot.append(plan.num_replicas.sum())
                    wbytes.append(plan.num_replicas.sum() * expert_bytes)
                    history = c
                token_mb = tokens * R * k * l_dim * 2 * (R - 1) / R / 1e6  # dispatch, uniform sources
                lb = -(-E * (R - 1) // (R * R))
                print(f"{E:>4} {R:>3} {k:>3} {alpha:>5.2f} {drift:>5.2f} | {np.mean(plain):>8.3f} "
                      f"{np.mean(eplb):>6.3f} {np.mean(moon):>6.3f} | {int(np.max(rmax)):>6d} (<= {E // R:>3d}) "
                      f"{np.mean(rtot):>10.1f} {lb:>3d} | {np.mean(wbytes) / 1e6:>15.1f} {token_mb:>14.1f}")
    print("weight MB/layer: replica prefetch per micro-batch and layer (EP-group total; the reduce-back moves the "
          "same in the grad dtype); token MB/layer: one dispatch (combine and the two backward all-to-alls move the "
          "same again each)")


# ------------------------------------------------------------------------------------------------------------------
def _k3_routes(E: int, R: int, k: int, tokens: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Per-rank top-k routes ``[tokens, k]`` with Zipf(alpha) expert popularity (same popularity on every rank)."""
    pop = 1.0 / np.arange(1, E + 1) ** alpha
    logp = np.log(pop[rng.permutation(E)]).astype(np.float32)[None, :]
    out = []
    for _ in range(R):
        g = logp + rng.gumbel(size=(tokens, E)).astype(np.float32)
        out.append(np.argpartition(-g, k - 1, axis=1)[:, :k].astype(np.int64))
    return out


def bench_layout(args: argparse.Namespace) -> None:
    """Per-layer planning + layout time of one rank: the dispatcher's path (one host copy of the gathered
    counts, plan on [R]/[n] lists, block-move layout) vs the readable reference (host plan, [R, R, E] split,
    sorts). The local expert sort of the routes is timed apart: it runs before the plan, overlapped with the
    count all-gather."""
    torch.set_num_threads(args.threads)
    E, R, k = args.experts, args.ranks, args.k
    rng = np.random.default_rng(args.seed)
    print(f"plan + layout per layer and micro-batch, one rank: E={E} R={R} top-{k}, {args.threads} thread(s), "
          f"median of {args.reps} (ms)")
    print(f"{'tokens':>6} {'alpha':>5} {'repl':>4} | {'fast':>7} {'(plan':>7} {'layout)':>8} | {'reference':>9} | "
          f"{'speed-up':>8} | {'local sort':>10}")
    for tokens in args.tokens:
        for alpha in args.alphas:
            routes = _k3_routes(E, R, k, tokens, alpha, rng)
            by_src = np.stack([np.bincount(r.reshape(-1), minlength=E) for r in routes])
            gathered = torch.as_tensor(by_src.reshape(-1))
            me = 0  # every rank builds its own layout; the cost hardly depends on which
            topk = torch.as_tensor(routes[me])
            t_local, t_plan, t_lay, t_ref = [], [], [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                local = local_route_positions(topk, E)
                t1 = time.perf_counter()
                host = counts_to_host(gathered, R)
                plan, takes = plan_with_takes(host.sum(0), R, True)
                t2 = time.perf_counter()
                lay = fast_rank_layout(plan, takes, host, me, local[2])
                t3 = time.perf_counter()
                t_local.append(t1 - t0)
                t_plan.append(t2 - t1)
                t_lay.append(t3 - t2)
            for _ in range(max(1, args.reps // 4)):
                t0 = time.perf_counter()
                ref_plan = plan_redundant_experts(by_src.sum(0), R)
                ref = build_rank_layout(ref_plan, by_src, me, topk, local=local)
                t_ref.append(time.perf_counter() - t0)
            if not (torch.equal(ref.send_order, lay.send_order) and torch.equal(ref.recv_perm, lay.recv_perm)):
                raise AssertionError("fast layout differs from the reference")
            fast = np.median(t_plan) + np.median(t_lay)
            print(f"{tokens:>6} {alpha:>5.2f} {int(plan.num_replicas.max()):>4} | {fast * 1e3:>7.2f} "
                  f"{np.median(t_plan) * 1e3:>7.2f} {np.median(t_lay) * 1e3:>8.2f} | {np.median(t_ref) * 1e3:>9.2f} | "
                  f"{np.median(t_ref) / fast:>7.1f}x | {np.median(t_local) * 1e3:>10.2f}")
    print("goal: fast <= 2 ms per layer (E=896, R=64); repl = most replicas on one rank")
    # the fast path is ~100 small numpy/torch calls and two short Python loops: its time scales with the host's
    # per-call overhead more than with its FLOP/s, so the same code differs by 2x between hosts
    py = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000
    npc = min(timeit.repeat("np.cumsum(a)", setup="import numpy as np; a = np.arange(64)", number=2000,
                            repeat=5)) / 2000
    print(f"host: sum(range(1000)) {py * 1e6:.1f} us, np.cumsum of 64 ints {npc * 1e6:.2f} us (per-call overhead)")


# ------------------------------------------------------------------------------------------------------------------
def _moe_cfg(args: argparse.Namespace) -> ModelConfig:
    """The measured MoE layer: no shared expert, no router balancing (the router bias sets the popularity)."""
    return ModelConfig(hidden_size=args.d, routed_expert_hidden_size=args.l, moe_intermediate_size=args.f,
                       num_experts=args.experts, num_experts_per_token=args.k, num_shared_experts=0,
                       router_balance="none")


def _mem_body(rank: int, world: int, args: argparse.Namespace) -> None:
    dims = ParallelDims(dp=world, ep=world, world_size=world, rank=rank).build_groups()
    cfg = _moe_cfg(args)
    n = args.experts // world
    rows = []
    for layers in args.layers:
        for mbs in args.mbs:
            res = {}
            for moonep in (False, True):
                torch.manual_seed(0)
                stack = nn.ModuleList(LatentMoE(cfg) for _ in range(layers))
                with torch.no_grad():  # Zipf-like popularity through the router bias: MoonEP hosts replicas
                    pop = 1.0 / np.arange(1, args.experts + 1) ** args.alpha
                    for moe in stack:
                        moe.router.bias.copy_(torch.as_tensor(np.log(pop) * args.bias_scale, dtype=torch.float32))
                state = apply_expert_parallel(stack, dims, moonep=moonep)

                def run(x: torch.Tensor) -> torch.Tensor:
                    for moe in stack:
                        x = x + moe(x)
                    return x

                g = torch.Generator().manual_seed(rank)
                xs = [torch.randn(args.tokens, args.d, generator=g) for _ in range(mbs)]
                run(xs[0]).sum().backward()  # warm-up: persistent token buffers and the replica pool exist
                with LiveBytes() as lb:
                    outs = [run(x) for x in xs]  # every micro-batch in flight, as in pipeline warm-up
                    held = lb.live
                    lb.reset_peak()
                    for o in reversed(outs):
                        o.sum().backward()
                    bwd_peak = lb.peak - held
                    del outs
                stats = torch.tensor([held, bwd_peak], dtype=torch.float64)
                dist.all_reduce(stats)
                pool = state.pool.nbytes()
                reps = max((d.last_plan.num_replicas.max() for d in state.dispatchers.values()), default=0)
                res[moonep] = (stats / world).tolist() + [pool, int(reps), state.buffers.nbytes()]
            rows.append((layers, mbs, res))
    if rank == 0:
        es = 4
        expert = 3 * args.l * args.f * es
        print(f"MoonEP extra bytes per rank (mean over {world} gloo ranks), E={args.experts} top-{args.k} l={args.l} "
              f"f={args.f} tokens/rank={args.tokens}, fp32; one replica expert = {expert} B, n = E/R = {n}")
        print(f"{'layers':>6} {'mbs':>3} | {'held after fwds: MoonEP - plain':>31} | "
              f"{'bwd peak: MoonEP - plain':>24} | "
              f"{'pool':>8} | {'repl':>4} | {'old design held':>15}")
        for layers, mbs, res in rows:
            plain, moon = res[False], res[True]
            print(f"{layers:>6} {mbs:>3} | {moon[0] - plain[0]:>31.0f} | {moon[1] - plain[1]:>24.0f} | "
                  f"{moon[2]:>8d} | {moon[3]:>4d} | {layers * mbs * n * expert:>15d}")
        print("held: live bytes after all forwards (activations, graphs; both variants compute the same rows in "
              "total); bwd peak: transient during the backwards (replica grads + reduce-back receive rounds); pool: "
              "the two shared replica banks (persistent, = 2*n*expert); old design held = layers*mbs*n*expert")


def bench_memory(args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(_mem_body, args.world, args, timeout=1800)


# ------------------------------------------------------------------------------------------------------------------
def _step_body(rank: int, world: int, args: argparse.Namespace) -> None:
    dims = ParallelDims(dp=world, ep=world, world_size=world, rank=rank).build_groups()
    cfg = _moe_cfg(args)
    results = {}
    for moonep in (False, True):
        torch.manual_seed(0)
        moe = LatentMoE(cfg)
        with torch.no_grad():  # Zipf-like popularity through the router bias
            pop = 1.0 / np.arange(1, args.experts + 1) ** args.alpha
            moe.router.bias.copy_(torch.as_tensor(np.log(pop) * args.bias_scale, dtype=torch.float32))
        apply_expert_parallel(moe, dims, moonep=moonep)
        x = torch.randn(args.tokens, args.d, generator=torch.Generator().manual_seed(rank))
        times = []
        for it in range(args.warmup + args.iters):
            dist.barrier()
            t0 = time.perf_counter()
            moe(x).square().sum().backward()
            dist.barrier()
            if it >= args.warmup:
                times.append(time.perf_counter() - t0)
        m = collect_moonep_metrics(moe)
        results[moonep] = (float(np.median(times)), m)
    if rank == 0:
        for moonep, (t, m) in results.items():
            print(f"moonep={str(moonep):5}  fwd+bwd {t * 1e3:8.2f} ms  load max/mean before "
                  f"{m['moonep/mean_max_over_mean_before']:.2f} after {m['moonep/mean_max_over_mean_after']:.2f}  "
                  f"replicas/microbatch {m['moonep/replicas'] / (args.warmup + args.iters):.1f}  "
                  f"weight bytes/microbatch {m['moonep/weight_bytes'] / (args.warmup + args.iters):.0f}")
        print(f"step time ratio MoonEP/plain = {results[True][0] / results[False][0]:.3f}")


def bench_step(args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"MoE layer fwd+bwd on {args.world} gloo ranks: E={args.experts} top-{args.k} d={args.d} l={args.l} "
          f"f={args.f} tokens/rank={args.tokens} zipf alpha={args.alpha} (router bias)")
    run_ranks(_step_body, args.world, args, timeout=1800)


def _moe_layer_args(p: argparse.ArgumentParser, **defaults: float) -> argparse.ArgumentParser:
    """The gloo runs' flags: ranks, the MoE layer's sizes, tokens per rank and the routing skew."""
    p.add_argument("--world", type=int, default=2)
    for name in ("experts", "k", "d", "l", "f", "tokens"):
        p.add_argument(f"--{name}", type=int, default=defaults[name])
    p.add_argument("--alpha", type=float, default=defaults["alpha"])
    p.add_argument("--bias-scale", type=float, default=defaults["bias_scale"],
                   help="router bias = scale * log(zipf popularity)")
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("planner")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.8, 1.2])
    p.add_argument("--drifts", type=float, nargs="+", default=[0.0, 0.3])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank per micro-batch")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    lo = sub.add_parser("layout")
    lo.add_argument("--experts", type=int, default=896)
    lo.add_argument("--ranks", type=int, default=64)
    lo.add_argument("--k", type=int, default=16)
    lo.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="tokens per rank per micro-batch")
    lo.add_argument("--alphas", type=float, nargs="+", default=[0.0, 1.0, 1.5])
    lo.add_argument("--reps", type=int, default=20)
    lo.add_argument("--threads", type=int, default=1)
    lo.add_argument("--seed", type=int, default=0)
    me = _moe_layer_args(sub.add_parser("memory"), experts=8, k=2, d=32, l=32, f=64, tokens=64, alpha=1.5,
                         bias_scale=0.3)
    me.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4])
    me.add_argument("--mbs", type=int, nargs="+", default=[1, 2, 4])
    s = _moe_layer_args(sub.add_parser("step"), experts=16, k=4, d=128, l=128, f=256, tokens=512, alpha=1.2,
                        bias_scale=0.05)
    s.add_argument("--iters", type=int, default=10)
    s.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    {"planner": bench_planner, "layout": bench_layout, "memory": bench_memory, "step": bench_step}[args.cmd](args)


if __name__ == "__main__":
    main()
