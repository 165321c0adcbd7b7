"""Benchmark KCP: bytes moved per rank per layer (analytic at K3 dims, measured with gloo) and the fold's time share.

    .venv/bin/python benchmarks/bench_kcp.py                       # analytic table + gloo runs at CP 2 and 4
    .venv/bin/python benchmarks/bench_kcp.py --cp 2 --T 512 2048 --reps 2

Part 1 (analytic, K3 dims: 96 heads x 128, latent 576, conv kernel 4, one row): bytes moved per rank per KDA layer
(forward + backward) by KCP -- the (M, S~) all-gather, the entry-gradient all-gather, the conv halos -- next to
all-gathering the bf16 K and V of the preceding segments (and K, V, g, beta, which a recompute-from-inputs
scheme actually needs), and the MLA latent all-gather + reduce-scatter. "Moved per rank" = what a ring
collective puts on each rank's link (see kcp/comm.py).

Part 1c (analytic): bytes per rank per micro-batch of building the KCP context: the shape all-gather plus the
segment edge summaries ([B, 5] int64, kcp/edges.py) now, against all-gathering every token's doc id and
position (2 * B * T int64) before; Part 2 also measures it.

Part 2 (measured, gloo on this CPU, small dims): one row, one document spanning all ranks (the worst case for the
fold); per CP rank the wall time of the KCP KDA forward+backward, of the gather+fold sections (forward and
backward), of the local widened forward pass (kcp/pairs.py: augmented_pass), and of plain chunk_kda on the same
segment without CP; the table shows the slowest rank and the measured KDA bytes per call (flat in T). Timings on a
shared CPU are indicative only.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from k3train.ops.kda import chunk_kda  # noqa: E402
from k3train.runtime.local_workers import run_ranks  # noqa: E402
from kcp import KCPContext  # noqa: E402
from kcp.edges import EDGE_FIELDS  # noqa: E402
from kcp.fold import fold_adjoint, fold_entry  # noqa: E402
from kcp.pairs import flatten_tokens  # noqa: E402

K3 = dict(H=96, K=128, V=128, latent=576, conv_n=3, act_bytes=2)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def analytic_rows(cps: list[int], t_fulls: list[int]) -> list[tuple]:
    H, K, V, L, n, ab = K3["H"], K3["K"], K3["V"], K3["latent"], K3["conv_n"], K3["act_bytes"]
    rows = []
    for cp in cps:
        for T in t_fulls:
            t = T // cp
            kcp_fwd = (cp - 1) * H * K * (K + V) * 4           # fp32 (M, S~) all-gather
            kcp_bwd = (cp - 1) * H * K * V * 4                 # fp32 dL/dE all-gather
            halo = 2 * (cp - 1) * 3 * min(n, t) * H * K * ab   # q, k, v halo tails: all-gather + reduce-scatter
            kv = 2 * (cp - 1) * t * H * (K + V) * ab           # all-gather K, V fwd + reduce-scatter grads bwd
            kvgb = 2 * (cp - 1) * t * H * (ab * (K + V) + 4 * K + 4)  # + fp32 g and beta
            mla = (cp - 1) * t * L * ab + (cp - 1) * t * L * ab  # latent all-gather + grad reduce-scatter
            rows.append((cp, T, kcp_fwd + kcp_bwd + halo, kv, kvgb, mla))
    return rows


def context_bytes(cp: int, t: int, rows: int = 1) -> tuple[int, int]:
    """``(before, now)``: bytes moved per rank and micro-batch to build a KCP context for ``rows`` rows of ``t``
    local tokens: the [B, T] shape all-gather plus the doc_ids + positions all-gather (before) or the edge
    summaries (now)."""
    shape = (cp - 1) * 2 * 8
    return shape + (cp - 1) * 2 * rows * t * 8, shape + (cp - 1) * rows * len(EDGE_FIELDS) * 8


def print_context_bytes(cps: list[int], t_fulls: list[int]) -> None:
    print("Part 1c: bytes per rank per micro-batch to build the KCP context (one row; int64)")
    print(f"{'cp':>3} {'T_full':>8} | {'AG doc_ids+pos':>14} {'edge summaries':>14} {'ratio':>9}")
    for cp in cps:
        for T in t_fulls:
            before, now = context_bytes(cp, T // cp)
            print(f"{cp:>3} {T:>8} | {fmt_bytes(before):>14} {fmt_bytes(now):>14} {before / now:>8.0f}x")
    print()


def chunk_kda_flops_per_token(H: int, K: int, V: int, C: int = 64) -> float:
    """Approximate forward FLOPs per token of the chunked KDA core (grams, UT solve, outputs, chunk states)."""
    per_chunk = C * C * (7 * K + 3 * V) + C * (2 * K * K + 4 * K * V) + 2 * K * K * V
    return H * per_chunk / C


def print_fold_flops(cps: list[int], t_fulls: list[int]) -> None:
    H, K, V = K3["H"], K3["K"], K3["V"]
    core = 3 * chunk_kda_flops_per_token(H, K, V)  # forward + backward ~ 3x forward
    print("Part 1b: fold arithmetic vs the chunked KDA core on one rank (K3 dims, fwd+bwd FLOPs, one row)")
    print(f"{'cp':>3} {'T_full':>8} | {'fold GFLOP':>10} {'core GFLOP':>10} {'fold share':>10}")
    for cp in cps:
        fold = (2 * cp - 1) * 2 * H * K * K * V  # (cp-1) fwd steps + (cp-1) adjoint steps + dM
        for T in t_fulls:
            c = core * (T // cp)
            print(f"{cp:>3} {T:>8} | {fold / 1e9:>10.2f} {c / 1e9:>10.0f} {100 * fold / c:>9.4f}%")
    print()


def print_analytic(cps: list[int], t_fulls: list[int]) -> None:
    print("Part 1: bytes moved per rank per layer, forward + backward, K3 dims, one row")
    print(f"{'cp':>3} {'T_full':>8} | {'KCP KDA':>10} {'AG K,V':>10} {'AG K,V,g,b':>11} {'ratio':>8} | "
          f"{'MLA latent':>10}")
    for cp, T, kcp, kv, kvgb, mla in analytic_rows(cps, t_fulls):
        print(f"{cp:>3} {T:>8} | {fmt_bytes(kcp):>10} {fmt_bytes(kv):>10} {fmt_bytes(kvgb):>11} "
              f"{kv / kcp:>7.0f}x | {fmt_bytes(mla):>10}")
    print()


# ------------------------------------------------------------------------------------------------------------
def _inputs(T: int, H: int, K: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, K, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, generator=gen) - 2.0)
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    return [q, k, v, g, beta]


def fold_compute_seconds(plan, H: int, K: int, reps: int, B: int = 1) -> float:
    """Wall time of the fold's arithmetic alone (forward fold + adjoint + dM), no communication."""
    gen = torch.Generator().manual_seed(0)
    Ms = 0.1 * torch.randn(plan.cp, B, H, K, K, generator=gen)
    Ss = torch.randn(plan.cp, B, H, K, K, generator=gen)
    t0 = time.perf_counter()
    for _ in range(reps):
        E = fold_entry(Ms, Ss, plan)
        A = fold_adjoint(Ms[plan.rank + 1:], Ss, plan)
        _ = A @ E.transpose(-1, -2)
    return (time.perf_counter() - t0) / reps


def _worker(rank: int, cp: int, t_fulls: list[int], H: int, K: int, reps: int) -> dict[int, dict]:
    """One gloo rank of :func:`run_measured`: its timings and bytes per full row length."""
    out = {}
    for T in t_fulls:
        t = T // cp
        full = _inputs(T, H, K, seed=T)
        loc = [x[:, rank * t:(rank + 1) * t].clone().requires_grad_(True) for x in full]
        doc_ids = torch.zeros(1, t, dtype=torch.long)  # one document over every rank
        res = dict(total=0.0, fold=0.0, pairs=0.0, local=0.0, bytes=0)
        for it in range(reps + 1):  # the first iteration warms up
            ctx = KCPContext(None if cp == 1 else dist.group.WORLD, doc_ids,
                             torch.arange(rank * t, (rank + 1) * t)[None])
            dist.barrier()
            t0 = time.perf_counter()
            o, _ = ctx.kda_with_state(*loc, output_final_state=False)
            o.sum().backward()
            t_total = time.perf_counter() - t0
            t0 = time.perf_counter()
            o2, _ = chunk_kda(*(flatten_tokens(x) for x in loc))
            o2.sum().backward()
            t_local = time.perf_counter() - t0
            if it > 0:
                s = ctx.stats.seconds
                res["total"] += t_total / reps
                res["fold"] += (s["kda_fold_fwd"] + s["kda_fold_bwd"]) / reps
                res["pairs"] += s["kda_local_fwd"] / reps
                res["local"] += t_local / reps
                res["bytes"] = ctx.stats.bytes["kda_fwd"] + ctx.stats.bytes["kda_bwd"]
                res["ctx_bytes"] = ctx.stats.bytes["layout"]
        res["fold_compute"] = fold_compute_seconds(ctx.plan, H, K, reps)
        out[T] = res
    return out


def run_measured(cp: int, t_fulls: list[int], H: int, K: int, reps: int) -> dict[int, list[dict]]:
    """Per full row length, every rank's timings and bytes (rank order)."""
    per_rank = run_ranks(_worker, cp, t_fulls, H, K, reps, timeout=1800)
    return {T: [mine[T] for mine in per_rank] for T in t_fulls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192], help="full row lengths (measured)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dk", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--analytic-only", action="store_true")
    args = ap.parse_args()

    print_analytic(sorted(set(args.cp) | {8, 16}), [32768, 131072, 524288, 1048576])
    print_fold_flops(sorted(set(args.cp) | {8, 16}), [131072, 1048576])
    print_context_bytes(sorted(set(args.cp) | {8, 16}), [32768, 1048576])
    if args.analytic_only:
        return
    H, K = args.heads, args.dk
    print(f"Part 2: gloo CPU, H={H}, dk=dv={K}, one row, one document over all ranks, slowest rank, "
          f"fwd+bwd, mean of {args.reps}")
    print(f"{'cp':>3} {'T_full':>7} | {'KCP kda ms':>10} {'local ms':>9} {'ratio':>6} | {'aug fwd ms':>10} "
          f"{'gather+fold':>11} {'fold math':>9} {'share':>6} | {'KDA bytes/rank':>14} {'AG K,V fp32':>11} | "
          f"{'ctx bytes':>10} {'was':>10}")
    for cp in args.cp:
        res = run_measured(cp, args.T, H, K, args.reps)
        for T in args.T:
            worst = max(res[T], key=lambda r: r["total"])
            fold = max(r["fold"] for r in res[T])
            math_s = max(r["fold_compute"] for r in res[T])
            pairs = max(r["pairs"] for r in res[T])
            kv = 2 * (cp - 1) * (T // cp) * H * 2 * K * 4
            print(f"{cp:>3} {T:>7} | {worst['total'] * 1e3:>10.1f} {worst['local'] * 1e3:>9.1f} "
                  f"{worst['total'] / worst['local']:>5.2f}x | {pairs * 1e3:>10.1f} {fold * 1e3:>11.2f} "
                  f"{math_s * 1e3:>9.3f} {100 * math_s / worst['total']:>5.2f}% | "
                  f"{fmt_bytes(max(r['bytes'] for r in res[T])):>14} {fmt_bytes(kv):>11} | "
                  f"{fmt_bytes(max(r['ctx_bytes'] for r in res[T])):>10} "
                  f"{fmt_bytes(context_bytes(cp, T // cp)[0]):>10}")
    print("ratio = KCP kda / plain chunk_kda on the same segment (slowest rank); gather+fold includes waiting for "
          "the slowest rank;\nfold math = the fold's arithmetic alone; share = fold math / KCP kda; ctx bytes = "
          "measured context construction per micro-batch (was = all-gathering doc_ids + positions).")


if __name__ == "__main__":
    main()
