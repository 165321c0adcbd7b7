#!/usr/bin/env python
"""Benchmark KDA forward + backward: the hand-written-backward op vs the autograd reference vs a naive reference.

Ops compared (same inputs, ``o`` from zero state, loss = <o, w>, gradients of q, k, v, g, beta):
  * ``new``      -- :func:`k3train.ops.kda.chunk_kda` (``torch.autograd.Function``, :mod:`k3train.ops.kda_function`),
                    with ``g_lower_bound`` = K3's gate bound (dense diagonal sub-tiles);
  * ``autograd`` -- :func:`k3train.ops.kda.chunk_kda_autograd` (the previous op, differentiated by autograd);
  * ``naive``    -- flash-linear-attention's pure-torch ``fla.ops.kda.naive.naive_chunk_kda`` when ``fla`` is
                    installed, else this repo's token loop :func:`k3train.ops.kda_naive.naive_recurrent_kda`
                    (the header line says which); run only up to ``--naive-max-t``.

Per (T, K = V): median wall time of fwd+bwd, speed-ups of ``new``, achieved GFLOP/s as a fraction of plain
``torch.matmul`` measured in the same run right before the row (the host's matmul speed moves by +-15% over
minutes), autograd-saved bytes / input bytes (``saved_tensors_hooks``, distinct
storages), and max |o_new - o_autograd|. A second header line gives the GFLOP/s of the batched GEMM shapes the
chunk form is made of (``[NC*H] x 64x64 @ 64xK``, ``64xK @ KxV``), as a fraction of the same matmul figure:
the practical ceiling for any chunked op built from batched matmuls on this machine.

FLOP count (nominal, dense-equivalent; forward, per chunk of C tokens per head, K = key dim, V = value dim):

    F_chunk = 4 C^2 K          two decayed Gram matrices A = (b K)(Gamma K)^T, P = Q (Gamma K)^T (counted full C x C)
            +   C^2 (K + V)    triangular solve (I + A)^{-1} [Diag(b) Gamma K | Diag(b) V]
            + 2 C^2 (K + V)    P W and P Uw
            + 2 C K (K + V)    chunk transition M = Diag(Gamma_C) - Kd^T W and H = Kd^T Uw
            + 2 K^2 V          state fold S <- M S + H
            + 2 C K V          (Gamma Q - P W) S
    F_fwd = B H ceil(T / C) F_chunk,   F_fwd+bwd = 3 F_fwd   (backward counted as twice the forward).

Goals (issue 13) at T=4096, H=4, K=V=128, one thread: new >= 2x autograd, >= 40% of matmul FLOP/s, saved bytes
<= 3x input bytes. On an idle machine::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_kda.py --threads 1

The host allocator keeps freed memory (:func:`k3train.runtime.host_memory.keep_freed_memory`, as a device's caching
allocator does), so the times are the ops' work rather than the kernel zero-filling the pages that glibc returned
and takes back on every call; ``--host-alloc default`` leaves glibc as it comes.

This is a tool, not a test. ``--clock thread`` times with the calling thread's CPU time (meaningful with
``--threads 1`` only), for A/B comparisons on a loaded machine.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3train.runtime.host_memory import keep_freed_memory  # noqa: E402
from k3train.ops.kda import chunk_kda, chunk_kda_autograd  # noqa: E402
from k3train.ops.kda_naive import naive_recurrent_kda  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def naive_reference(naive_file: str = "") -> tuple[str, Callable, bool]:
    """(name, fn, needs T % 64 == 0): fla's pure-torch chunk reference when installed (or loaded from
    ``naive_file``, fla's ``fla/ops/kda/naive.py``: on a CPU machine the ``fla`` package itself does not import,
    its ``__init__`` needs Triton, but that one file needs only torch and einops), else our token loop."""
    if naive_file:
        spec = importlib.util.spec_from_file_location("fla_kda_naive", naive_file)
        if spec is None or spec.loader is None:
            raise SystemExit(f"--naive-file {naive_file}: not a Python file")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return f"fla naive_chunk_kda from {naive_file}", mod.naive_chunk_kda, True
    try:
        # lazy: fla is optional (not installed on CPU machines)
        from fla.ops.kda.naive import naive_chunk_kda  # type: ignore[import-not-found]
    except ImportError:
        return "k3train.ops.kda_naive.naive_recurrent_kda (fla not installed)", naive_recurrent_kda, False
    return "fla.ops.kda.naive.naive_chunk_kda", naive_chunk_kda, True


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


class Clock:
    def __init__(self, kind: str, device: str) -> None:
        self.kind, self.device = kind, device

    def now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.thread_time() if self.kind == "thread" else time.perf_counter()


def fwd_bwd(fn: Callable, inputs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    o, _ = fn(*inputs)
    torch.autograd.grad((o.float() * w).sum(), inputs)
    return o.detach()


def timed(fn: Callable, inputs, w, repeats: int, clock: Clock, warm_up: bool = True) -> tuple[float, torch.Tensor]:
    """Median seconds of ``repeats`` fwd+bwd runs (after one untimed warm-up run unless ``warm_up`` is False)."""
    out = fwd_bwd(fn, inputs, w) if warm_up else None
    times = []
    for _ in range(repeats):
        t0 = clock.now()
        out = fwd_bwd(fn, inputs, w)
        times.append(clock.now() - t0)
    return statistics.median(times), out


def saved_ratio(fn: Callable, inputs: list[torch.Tensor]) -> float:
    """Bytes of distinct storages autograd saves for one forward call, over the input bytes."""
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        st = x.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(*inputs)
    return sum(seen.values()) / sum(x.numel() * x.element_size() for x in inputs)


def gflops_of(f: Callable[[], object], flops: float, repeats: int, clock: Clock) -> float:
    f()
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = clock.now()
        f()
        best = min(best, clock.now() - t0)
    return flops / best / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,16384", help="comma-separated sequence lengths T")
    p.add_argument("--dims", default="64,128", help="comma-separated head dims (K = V)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--g-lower-bound", type=float, default=-5.0, help="gate bound passed to the new op (K3: -5)")
    p.add_argument("--autograd-max-t", type=int, default=16384, help="skip the autograd op beyond this T")
    p.add_argument("--naive-max-t", type=int, default=0,
                   help="skip the naive reference beyond this T (default: 4096 for fla's, 1024 for the token loop)")
    p.add_argument("--naive-file", default="",
                   help="fla's fla/ops/kda/naive.py to load by path (pip download fla-core --no-deps; needs einops)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave torch's default)")
    p.add_argument("--matmul-n", type=int, default=2048, help="square fp32 matmul size for the peak reference")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall")
    p.add_argument("--host-alloc", choices=["keep", "default"], default="keep",
                   help="keep: the host allocator keeps freed memory (k3train/runtime/host_memory.py), so the times are the "
                        "ops' work and not the kernel's page zeroing; default: glibc as it comes")
    a = p.parse_args(argv)
    alloc = keep_freed_memory() if a.host_alloc == "keep" else "host allocator unchanged (--host-alloc default)"
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]
    clock = Clock(a.clock, a.device)
    naive_name, naive_fn, naive_needs_chunks = naive_reference(a.naive_file)
    naive_max = a.naive_max_t or (4096 if naive_needs_chunks else 1024)
    new = lambda *x: chunk_kda(*x, chunk_size=a.chunk_size, g_lower_bound=a.g_lower_bound)  # noqa: E731
    old = lambda *x: chunk_kda_autograd(*x, chunk_size=a.chunk_size)  # noqa: E731

    n = a.matmul_n
    mats = torch.randn(n, n, device=a.device), torch.randn(n, n, device=a.device)
    matmul_peak = lambda: gflops_of(lambda: mats[0] @ mats[1], 2 * n ** 3, a.repeats, clock)  # noqa: E731
    peak = matmul_peak()
    C, D = a.chunk_size, max(int(x) for x in a.dims.split(","))
    bmm = {}
    for name, (m, kk, nn) in {f"{C}x{C}@{C}x{D}": (C, C, D), f"{C}x{D}@{D}x{D}": (C, D, D)}.items():
        x, y = torch.randn(256, m, kk, device=a.device), torch.randn(256, kk, nn, device=a.device)
        bmm[name] = gflops_of(lambda: x @ y, 2 * 256 * m * kk * nn, a.repeats, clock)
    print(f"device={a.device} threads={torch.get_num_threads()} dtype={a.dtype} B={a.batch} H={a.heads} "
          f"C={C} g_lower_bound={a.g_lower_bound} clock={a.clock} repeats={a.repeats} (median); {alloc}")
    print(f"torch.matmul fp32 {n}x{n}: {peak:.1f} GFLOP/s at the start (the 'of mm' reference is measured again "
          f"right before each row's timings: the column 'mm GF/s'); batched 256x "
          + ", ".join(f"{k}: {v:.1f} ({v / peak:.0%})" for k, v in bmm.items()))
    print(f"naive reference: {naive_name}, up to T={naive_max}")
    print("FLOPs(fwd+bwd) = 3 * B*H*ceil(T/C) * [4C^2K + 3C^2(K+V) + 2CK(K+V) + 2K^2V + 2CKV]")
    hdr = (f"{'T':>6} {'K=V':>4} {'new ms':>8} {'autograd':>9} {'naive ms':>9} {'vs auto':>8} {'vs naive':>9} "
           f"{'GFLOP':>7} {'mm GF/s':>8} {'new/mm':>7} {'auto/mm':>8} {'saved new':>10} {'saved auto':>11} "
           f"{'max|do|':>9}")
    print(hdr)
    print("-" * len(hdr))
    for D in [int(x) for x in a.dims.split(",")]:
        for T in [int(x) for x in a.lengths.split(",")]:
            inputs = make_inputs(a.batch, T, a.heads, D, D, dtype, a.device)
            w = torch.randn(a.batch, T, a.heads, D, device=a.device)
            flops = kda_flops(a.batch, T, a.heads, D, D, C)
            peak = matmul_peak()  # the host's speed drifts (above): the reference beside the row
            t_new, o_new = timed(new, inputs, w, a.repeats, clock)
            s_new = saved_ratio(new, inputs)
            cells = {"auto": "-", "naive": "-", "vs auto": "-", "vs naive": "-", "auto/mm": "-", "saved auto": "-",
                     "err": "-"}
            if T <= a.autograd_max_t:
                t_old, o_old = timed(old, inputs, w, a.repeats, clock)
                cells.update({"auto": f"{t_old * 1e3:.1f}", "vs auto": f"{t_old / t_new:.2f}x",
                              "auto/mm": f"{flops / t_old / 1e9 / peak:.1%}",
                              "saved auto": f"{saved_ratio(old, inputs):.2f}x",
                              "err": f"{(o_new.float() - o_old.float()).abs().max().item():.2e}"})
            if T <= naive_max and (not naive_needs_chunks or T % 64 == 0):
                t_naive, _ = timed(naive_fn, inputs, w, 1, clock, warm_up=False)
                cells.update({"naive": f"{t_naive * 1e3:.1f}", "vs naive": f"{t_naive / t_new:.1f}x"})
            print(f"{T:>6} {D:>4} {t_new * 1e3:8.1f} {cells['auto']:>9} {cells['naive']:>9} {cells['vs auto']:>8} "
                  f"{cells['vs naive']:>9} {flops / 1e9:7.2f} {peak:8.1f} {flops / t_new / 1e9 / peak:7.1%} "
                  f"{cells['auto/mm']:>8} {s_new:9.2f}x {cells['saved auto']:>11} {cells['err']:>9}")
    print("saved = autograd-saved bytes / input bytes; vs = speed-up of new; x/mm = achieved / matmul FLOP/s")


if __name__ == "__main__":
    main()
