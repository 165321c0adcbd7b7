#!/usr/bin/env python
"""Benchmark chunked KDA (k3train.ops.kda.chunk_kda) against the token-loop reference, forward + backward.

Prints one table row per (T, head dim): wall time of chunked and naive fwd+bwd, speed-up, the chunked op's achieved
GFLOP/s and that figure as a fraction of plain ``torch.matmul`` GFLOP/s measured on the same machine in the same run,
the max |o_chunk - o_naive| as a sanity check, and the bytes autograd saves for the chunked backward.

FLOP count (nominal, dense-equivalent; forward, per chunk of C tokens per head, K = key dim, V = value dim):

    F_chunk = 4 C^2 K          two decayed Gram matrices A = (b K)(Gamma K)^T, P = Q (Gamma K)^T (counted full C x C)
            +   C^2 (K + V)    triangular solve (I + A)^{-1} [Diag(b) Gamma K | Diag(b) V]
            + 2 C^2 (K + V)    P W and P Uw
            + 2 C K (K + V)    chunk transition M = Diag(Gamma_C) - Kd^T W and H = Kd^T Uw
            + 2 K^2 V          state fold S <- M S + H
            + 2 C K V          (Gamma Q - P W) S
    F_fwd = B H ceil(T / C) F_chunk,   F_fwd+bwd = 3 F_fwd   (backward counted as twice the forward).

Example: ``python tools/bench_kda.py --lengths 256,1024,4096 --dims 64,128 --heads 4 --naive-max-t 1024``.
This is a tool, not a test: timings on a shared machine are noisy; the best of ``--repeats`` runs is reported.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3train.ops.kda import chunk_kda, naive_recurrent_kda  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def kda_flops(B: int, T: int, H: int, K: int, V: int, C: int = 64) -> float:
    """Nominal forward+backward FLOPs of the chunked op (formula in the module docstring)."""
    per_chunk = 4 * C * C * K + C * C * (K + V) + 2 * C * C * (K + V) + 2 * C * K * (K + V) + 2 * K * K * V \
        + 2 * C * K * V
    return 3.0 * B * H * math.ceil(T / C) * per_chunk


def make_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))          # K3 lower-bounded gate
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v, g, beta)]


def fwd_bwd(fn, inputs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    for x in inputs:
        x.grad = None
    o, _ = fn(*inputs)
    (o.float() * w).sum().backward()
    return o.detach()


def timed(fn, inputs, w, repeats: int, device: str) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fwd_bwd(fn, inputs, w)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def saved_bytes(fn, inputs: list[torch.Tensor]) -> int:
    """Bytes of distinct storages autograd saves for the backward of one forward call."""
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        st = x.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(*inputs)
    return sum(seen.values())


def matmul_gflops(n: int, repeats: int, device: str) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,1024,4096", help="comma-separated sequence lengths T")
    p.add_argument("--dims", default="64,128", help="comma-separated head dims (K = V)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--naive-max-t", type=int, default=1024, help="skip the token-loop reference beyond this T")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave torch's default)")
    p.add_argument("--matmul-n", type=int, default=2048, help="square fp32 matmul size for the peak reference")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]

    peak = matmul_gflops(a.matmul_n, a.repeats, a.device)
    print(f"device={a.device} threads={torch.get_num_threads()} dtype={a.dtype} B={a.batch} H={a.heads} "
          f"repeats={a.repeats} (best of)")
    print(f"torch.matmul fp32 {a.matmul_n}x{a.matmul_n}: {peak:.1f} GFLOP/s (reference peak, same run)")
    print("FLOPs(fwd+bwd) = 3 * B*H*ceil(T/64) * [4C^2K + 3C^2(K+V) + 2CK(K+V) + 2K^2V + 2CKV], C=64")
    hdr = (f"{'T':>6} {'K=V':>4} {'chunk ms':>9} {'naive ms':>9} {'speedup':>8} {'GFLOP':>7} {'GFLOP/s':>8} "
           f"{'of mm':>6} {'max|do|':>9} {'saved MB':>9}")
    print(hdr)
    print("-" * len(hdr))
    skipped = []
    for D in [int(x) for x in a.dims.split(",")]:
        for T in [int(x) for x in a.lengths.split(",")]:
            inputs = make_inputs(a.batch, T, a.heads, D, D, dtype, a.device)
            w = torch.randn(a.batch, T, a.heads, D, device=a.device)
            fwd_bwd(chunk_kda, inputs, w)                                              # warm-up
            t_chunk, o_chunk = timed(chunk_kda, inputs, w, a.repeats, a.device)
            mem = saved_bytes(chunk_kda, inputs) / 2 ** 20
            flops = kda_flops(a.batch, T, a.heads, D, D)
            rate = flops / t_chunk / 1e9
            if T <= a.naive_max_t:
                t_naive, o_naive = timed(naive_recurrent_kda, inputs, w, 1, a.device)
                err = (o_chunk.float() - o_naive.float()).abs().max().item()
                naive_s, speed_s, err_s = f"{t_naive * 1e3:9.1f}", f"{t_naive / t_chunk:7.1f}x", f"{err:9.2e}"
            else:
                skipped.append(f"T={T},K={D}")
                naive_s, speed_s, err_s = f"{'skipped':>9}", f"{'-':>8}", f"{'-':>9}"
            print(f"{T:>6} {D:>4} {t_chunk * 1e3:9.1f} {naive_s} {speed_s} {flops / 1e9:7.2f} {rate:8.1f} "
                  f"{rate / peak:6.1%} {err_s} {mem:9.1f}")
    if skipped:
        print(f"naive reference skipped (T > --naive-max-t={a.naive_max_t}): {', '.join(skipped)}")


if __name__ == "__main__":
    main()
