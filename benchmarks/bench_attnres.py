"""Benchmark Block AttnRes against the standard PreNorm residual (``model.residual``): step time and saved bytes.

    .venv/bin/python benchmarks/bench_attnres.py                                   # configs/small.yaml, both layouts
    .venv/bin/python benchmarks/bench_attnres.py --bytes-only                      # only the (deterministic) bytes
    .venv/bin/python benchmarks/bench_attnres.py --layouts single --steps 5 --train.seq_len=512
    .venv/bin/python benchmarks/bench_attnres.py --aggregation                     # one aggregation: fused vs reference
    .venv/bin/python benchmarks/bench_attnres.py --layouts pp2vpp2 --recompute on --steps 8 --profile

For each residual (attnres, standard), layout (``single``: one process; ``pp2vpp2``: two gloo processes, pp=2 x
vpp=2, interleaved 1F1B) and ``parallel.recompute`` (off, on; ``model.attn_res_recompute`` as the config sets it),
one step's micro-batches (``global_batch_size / micro_batch_size``, synthetic tokens with EOS every ~60 tokens)
run through the trainer's own step runner (``parallel.pipeline.build_step_runner``: LocalRunner / PipelineRunner)
on CPU:

* step time: median over ``--steps`` forward+backward steps after ``--warmup`` (slowest rank). Both residuals'
  runners live in the same processes and their steps alternate (A B, B A, A B, ...), so step i of one and step i
  of the other are adjacent in time: the AttnRes overhead is the median over i of ``attnres_i / standard_i - 1``
  (K3 report: < 4% under PP; goal here <= 5%), with the range of those pair ratios beside it. The host drifts by
  several percent from one 30 s step to the next even when idle; pairing cancels the drift that is slower than a
  pair. *Quartets* go one further: two consecutive pairs ran in opposite orders (B A, A B), so one ratio over the
  four steps cancels a drift that is linear over them; the same is shown on the slowest rank's main-thread CPU
  seconds, which leave out receive and scheduler waits. Timings need an idle machine.
* ``--profile``: one more step of each residual under the torch profiler, and per rank the self CPU time of the
  ops whose call counts differ between the two (the aggregations, their backward, the pre-norms they replace).
  Every other op runs equally often on the same shapes in both, so this is the residual's own cost, free of the
  host's drift (on one host the same op's time moved 10% between two adjacent steps).
* saved bytes per micro-batch: storage bytes a micro-batch's forward leaves alive for its backward, booked by
  :class:`k3train.planning.fakerun.live_bytes.LiveBytes` (the counter the memory estimator and ``tools/memory.py
  --measure`` use) -- live bytes after minus before each forward (each of the rank's chunks of micro-batch 0 in
  the pipeline, summed; the most loaded rank). Deterministic: storage sizes, no allocator. Under pp the same is
  printed per (rank, local chunk): with ``parallel.recompute`` a chunk's forward keeps little more than its output
  state, which under AttnRes is the block representations the spec keeps resident (b_0, the embedding, included)
  instead of one hidden state.
* activation peak: the step's peak of live bytes above the bytes alive at its start (params, grads), worst rank:
  in the pipeline this includes every in-flight micro-batch, the AttnRes block cache and the p2p buffers.

Any ``--section.key=value`` is passed to the config (e.g. a smaller ``--train.seq_len`` for a quick look).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.profiler
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3train.config import load_config  # noqa: E402
from k3train.data.batch import Batch  # noqa: E402
from k3train.model.attnres import AttnRes  # noqa: E402
from k3train.model.attnres_fused import rms_norm  # noqa: E402
from k3train.model.norm import RMSNorm  # noqa: E402
from k3train.planning.fakerun.live_bytes import LiveBytes  # noqa: E402
from k3train.runtime.local_workers import run_ranks  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.pipeline import LossNorm, build_step_runner  # noqa: E402
from parallel.pipeline.partition import build_partition  # noqa: E402

LAYOUTS = {"single": (1, 1), "pp2vpp2": (2, 2)}
RESIDUALS = ("attnres", "standard")


def make_cfg(config: str, residual: str, pp: int, vpp: int, recompute: bool, overrides: list[str]) -> Any:
    ov = [*overrides, f"--model.residual={residual}", f"--parallel.pp={pp}", f"--parallel.vpp={vpp}",
          f"--parallel.recompute={str(recompute).lower()}", "--parallel.dp=1", "--train.device=cpu"]
    return load_config(config, ov, world_size=pp)


def micro_batches(cfg: Any, seed: int = 0) -> list[Batch]:
    """One step's micro-batches: random tokens, an EOS about every 60 tokens (several documents per row)."""
    g = torch.Generator().manual_seed(seed)
    mbs, T, V, eos = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.vocab_size, cfg.model.eos_token_id
    out = []
    for _ in range(cfg.train.global_batch_size // mbs):
        s = torch.randint(3, V, (mbs, T + 1), generator=g)
        s[torch.rand(s.shape, generator=g) < 1 / 60] = eos
        out.append(Batch.from_samples(s, eos_id=eos))
    return out


class _Saved:
    """Live bytes a forward leaves behind: ``begin()`` before it, ``end()`` after (summed per micro-batch and local
    chunk)."""

    def __init__(self, lb: LiveBytes) -> None:
        self.lb, self.by_mb_chunk, self._start = lb, {}, 0

    def begin(self) -> None:
        self._start = self.lb.live

    def end(self, mb: int, chunk: int = 0) -> None:
        key = (mb, chunk)
        self.by_mb_chunk[key] = self.by_mb_chunk.get(key, 0) + self.lb.live - self._start

    def of_mb(self, mb: int) -> dict[int, int]:
        """Bytes per local chunk of micro-batch ``mb``."""
        return {c: b for (m, c), b in self.by_mb_chunk.items() if m == mb}


def _instrument(runner: Any, saved: _Saved, norm: LossNorm) -> LossNorm:
    """Hook the forward boundaries: PipelineRunner._forward per action; LocalRunner: ``make_seq`` opens a
    micro-batch and the loss norm (called on the forward's sums) closes it. Returns the norm to pass."""
    if hasattr(runner, "_forward"):
        fwd = runner._forward

        def forward(a: Any) -> None:
            saved.begin()
            fwd(a)
            saved.end(a.mb, a.chunk)
        runner._forward = forward
        return norm
    make_seq, count = runner.make_seq, [0]

    def seq(batch: Any) -> Any:
        out = make_seq(batch)
        saved.begin()
        return out
    runner.make_seq = seq

    class _Norm:
        def __call__(self, sums: dict) -> torch.Tensor:
            saved.end(count[0])
            count[0] += 1
            return norm(sums)
    return _Norm()  # type: ignore[return-value]


def run_rank(rank: int, world: int, cfgs: list[Any], steps: int, warmup: int,
             profile: bool = False) -> list[dict[str, Any]]:
    """Build this rank's runner for each config (the residuals), time ``steps`` steps of each INTERLEAVED (step i
    of every config, in an order that alternates from step to step, so that the host's drift over minutes --
    +-15% between two idle runs of this bench when the residuals ran one after the other -- falls on both alike),
    then one step of each under LiveBytes."""
    dims = ParallelDims.from_config(cfgs[0].parallel, world, rank)
    if world > 1:
        dims.build_groups()
    runs = []
    for cfg in cfgs:
        runner = build_step_runner(None, cfg, dims, device="cpu")
        batches = micro_batches(cfg)
        runs.append((runner, batches, LossNorm.from_batches(batches, cfg.model.mtp_loss_weight),
                     [p for m in runner.modules for p in m.parameters()]))

    def step(k: int) -> float:
        runner, batches, norm, params = runs[k]
        for p in params:
            p.grad = None
        if world > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        runner.forward_backward(batches, norm)
        return time.perf_counter() - t0, time.thread_time() - c0

    times: list[list[float]] = [[] for _ in runs]
    cpu: list[list[float]] = [[] for _ in runs]
    for i in range(warmup + steps):
        order = range(len(runs)) if i % 2 == 0 else reversed(range(len(runs)))
        for k in order:
            t, c = step(k)
            if i >= warmup:
                times[k].append(t)
                cpu[k].append(c)
    out = []
    for k, (runner, batches, norm, params) in enumerate(runs):
        lb = LiveBytes()
        saved = _Saved(lb)
        n = _instrument(runner, saved, norm)
        for p in params:
            p.grad = None
        with lb:
            lb.track(params)
            base = lb.live
            lb.reset_peak()
            runner.forward_backward(batches, n)
            peak = lb.peak - base
        out.append({"rank": rank, "times": times[k], "cpu": cpu[k], "saved_mb0": sum(saved.of_mb(0).values()),
                    "saved_chunks": saved.of_mb(0),
                    "peak": peak, "ops": profile_ops(step, k) if profile else None})
    return out


def profile_ops(step: Any, k: int) -> dict[str, Any]:
    """One more step of config ``k`` under the torch profiler: ``{'step_s', 'ops': {op: (self CPU s, calls)}}``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t, _ = step(k)
    return {"step_s": t, "ops": {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}}


def op_overhead(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float, list[tuple[str, float]]]:
    """The self CPU seconds of the work only one of two profiled steps does (``a`` minus ``b``):
    ``(exclusive, shared, largest)``. *exclusive*: ops that only one of them calls (AttnRes's aggregation and its
    backward against the standard residual's pre-norm); *shared*: ops both call but not equally often (the
    aggregations' elementwise ops), estimated as the extra calls times the op's mean time per call in the two
    steps. Ops called equally often do the same work on the same shapes in both (the residual changes none of the
    layers' GEMMs, KDA or MoE), so their time differences are the host's drift and are left out."""
    exclusive, shared, parts = 0.0, 0.0, {}
    for key in set(a["ops"]) | set(b["ops"]):
        (ta, ca), (tb, cb) = a["ops"].get(key, (0.0, 0)), b["ops"].get(key, (0.0, 0))
        if ca == cb:
            continue
        if ca == 0 or cb == 0:
            parts[key] = ta - tb
            exclusive += ta - tb
        else:
            parts[key] = (ca - cb) * (ta + tb) / (ca + cb)
            shared += parts[key]
    return exclusive, shared, sorted(parts.items(), key=lambda kv: -abs(kv[1]))[:4]


def run_layout(cfgs: list[Any], world: int, steps: int, warmup: int,
               profile: bool = False) -> list[list[dict[str, Any]]]:
    """Per config: every rank's result (rank order)."""
    if world == 1:
        return [[r] for r in run_rank(0, 1, cfgs, steps, warmup, profile)]
    per_rank = run_ranks(run_rank, world, cfgs, steps, warmup, profile, timeout=3600,
                         threads=max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    return [[rs[k] for rs in per_rank] for k in range(len(cfgs))]


def bench_aggregation(cfg: Any, reps: int = 20) -> None:
    """One aggregation + pre-norm, forward + backward, at the config's micro-batch shape and 1..max sources: the
    fused function (``attn_res_recompute``, k3train/model/attnres_fused.py) against the autograd reference, plain
    and checkpointed (what ``attn_res_recompute`` ran before), and the standard residual's pre-norm that it
    replaces, medians of ``reps``, in one run."""
    m = cfg.model
    B, T, d = cfg.train.micro_batch_size, cfg.train.seq_len, m.hidden_size
    torch.manual_seed(0)
    res, pre = AttnRes(d, m.rms_norm_eps), RMSNorm(d, m.rms_norm_eps)
    with torch.no_grad():
        res.query.normal_()
    ways = {"fused": lambda s: res(s, pre, True), "reference": lambda s: res(s, pre, False),
            "ref. checkpointed": lambda s: checkpoint(res._aggregate, pre, *s, use_reentrant=False),
            "standard pre-norm": lambda s: rms_norm(s[-1], pre)}  # what the standard residual runs instead
    print(f"aggregation + pre-norm, forward + backward, [{B}, {T}, {d}] {cfg.train.dtype}, median of {reps} (ms):")
    print(f"{'sources':>7} " + " ".join(f"{k:>17}" for k in ways) + f" {'speed-up vs ckpt':>17}")
    L, bs = m.num_hidden_layers, m.attn_res_block_size
    n_max = max(2 + (L - 1) // bs, 1 + L // bs + (L % bs > 0))  # a last layer's sources, the final aggregation's
    for n in range(1, n_max + 1):
        srcs = [torch.randn(B, T, d, requires_grad=True) for _ in range(n)]
        ms = {}
        for k, fn in ways.items():
            ts = []
            for i in range(reps + 3):
                t0 = time.perf_counter()
                y = fn(srcs)
                y.backward(torch.ones_like(y))
                if i >= 3:
                    ts.append(time.perf_counter() - t0)
            ms[k] = 1e3 * statistics.median(ts)
        print(f"{n:>7} " + " ".join(f"{v:>17.2f}" for v in ms.values())
              + f" {ms['ref. checkpointed'] / ms['fused']:>16.2f}x")


def quartets(a: list[float], b: list[float]) -> list[float]:
    """``(a_i + a_i+1) / (b_i + b_i+1) - 1`` over consecutive timed steps ``(0, 1), (2, 3), ...``: their two pairs
    ran in opposite orders, so a drift that is linear over the four steps falls on both sides equally."""
    return [(a[i] + a[i + 1]) / (b[i] + b[i + 1]) - 1 for i in range(0, len(a) - 1, 2)]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "small.yaml"))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--recompute", nargs="+", default=["off", "on"], choices=["off", "on"],
                    help="parallel.recompute settings to run")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bytes-only", action="store_true", help="no timed steps: only the saved / peak bytes")
    ap.add_argument("--profile", action="store_true",
                    help="one more step per residual under the torch profiler: the self CPU time of the ops whose "
                         "call counts differ between the residuals, per rank (free of the host's drift)")
    ap.add_argument("--aggregation", action="store_true",
                    help="only time one AttnRes aggregation + pre-norm: fused vs the autograd reference")
    return ap


def _same_partition(config: str, layout: str, overrides: list[str]) -> list[str]:
    """The overrides of both residuals' runs of ``layout``: at pp > 1 (unless ``--parallel.pp_layers`` is given)
    both on the AttnRes run's partition (the cost model and the cut tie-break differ by residual)."""
    pp, vpp = LAYOUTS[layout]
    same = list(overrides)
    if pp > 1 and not any(o.startswith("--parallel.pp_layers") for o in overrides):
        ref = make_cfg(config, "attnres", pp, vpp, False, overrides)
        sizes = build_partition(ref.model, ref.parallel, ref.train.seq_len).layers_per_stage()
        same.append(f"--parallel.pp_layers=[{','.join(map(str, sizes))}]")
        print(f"{layout}: layers per virtual stage {sizes} for both residuals")
    return same


def _spread(residual: str, per_step: dict[str, list[float]], per_cpu: dict[str, list[float]]
            ) -> tuple[str, str]:
    """A timed residual's overhead column (median of the step pairs against the standard residual) and, for
    AttnRes, the pairs' range, the quartets and the main-thread CPU quartets."""
    spread = ""
    pairs = [a / b - 1 for a, b in zip(per_step[residual], per_step["standard"])]
    over = f"{100 * statistics.median(pairs):+7.1f}%"
    if residual != "standard":
        spread = f"  pairs {100 * min(pairs):+.1f}..{100 * max(pairs):+.1f}%"
        quart = quartets(per_step[residual], per_step["standard"])
        if quart:
            spread += (f"; quartets {100 * statistics.median(quart):+.1f}% "
                       f"({100 * min(quart):+.1f}..{100 * max(quart):+.1f}%, {len(quart)})")
        cq = quartets(per_cpu[residual], per_cpu["standard"])
        if cq:
            spread += f"; main-thread CPU quartets {100 * statistics.median(cq):+.1f}%"
    return over, spread


def _print_profiles(profiles: dict[str, list[dict[str, Any]]]) -> None:
    for r, (pa, pb) in enumerate(zip(profiles["attnres"], profiles["standard"])):
        excl, shared, top = op_overhead(pa, pb)
        extra = excl + shared
        print(f"  profiled rank {r}: AttnRes's own ops {1e3 * extra:+.1f} ms ({1e3 * excl:+.1f} in ops only "
              f"one residual calls, {1e3 * shared:+.1f} estimated in extra calls of shared ops) of a "
              f"{pb['step_s']:.2f} s standard step ({100 * extra / pb['step_s']:+.2f}%); steps "
              f"{pa['step_s']:.2f} / {pb['step_s']:.2f} s; largest: "
              + ", ".join(f"{key} {1e3 * v:+.0f} ms" for key, v in top))


def bench_layout(args: argparse.Namespace, layout: str, rc: str, same: list[str], steps: int, warmup: int) -> None:
    """Both residuals of one layout and recompute setting: a row each, the saved bytes per chunk at pp > 1, and
    the profiles when asked."""
    pp, vpp = LAYOUTS[layout]
    res = {}
    cfgs = [make_cfg(args.config, residual, pp, vpp, rc == "on", same) for residual in RESIDUALS]
    per_step, per_cpu = {}, {}
    profiles, chunks = {}, {}
    for residual, ranks in zip(RESIDUALS, run_layout(cfgs, pp, steps, warmup, args.profile)):
        profiles[residual] = [r["ops"] for r in ranks]
        per_step[residual] = [max(ts) for ts in zip(*(r["times"] for r in ranks))]   # slowest rank
        per_cpu[residual] = [max(cs) for cs in zip(*(r["cpu"] for r in ranks))]
        t = statistics.median(per_step[residual]) if steps else float("nan")
        res[residual] = (t, max(r["saved_mb0"] for r in ranks), max(r["peak"] for r in ranks))
        chunks[residual] = {(r["rank"], c): b for r in ranks for c, b in r["saved_chunks"].items()}
    std = res["standard"]
    for residual in RESIDUALS:
        t, sv, pk = res[residual]
        over, spread = _spread(residual, per_step, per_cpu) if steps else (f"{'-':>8}", "")
        print(f"{layout:<8} {rc:<9} {residual:<9} | {t:>8.3f} {over} | {_mib(sv):>12} "
              f"{sv / max(std[1], 1):>6.3f} | {_mib(pk):>12} {pk / max(std[2], 1):>6.3f}{spread}")
    if pp > 1:  # where the saved bytes differ: the forward of each (rank, local chunk) of micro-batch 0
        print("  saved MiB of micro-batch 0 per (rank, local chunk), attnres / standard: " + ", ".join(
            f"r{r} c{c} {_mib(b)} / {_mib(chunks['standard'].get((r, c), 0))}"
            for (r, c), b in sorted(chunks["attnres"].items())))
    if args.profile:
        _print_profiles(profiles)


def main() -> None:
    args, overrides = _parser().parse_known_args()
    if args.aggregation:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        bench_aggregation(make_cfg(args.config, "attnres", 1, 1, False, overrides))
        return
    steps, warmup = (0, 0) if args.bytes_only else (args.steps, args.warmup)

    print(f"{'layout':<8} {'recompute':<9} {'residual':<9} | {'step s':>8} {'overhead':>8} | "
          f"{'saved MiB/mb':>12} {'ratio':>6} | {'act peak MiB':>12} {'ratio':>6}")
    for layout in args.layouts:
        same = _same_partition(args.config, layout, overrides)
        for rc in args.recompute:
            bench_layout(args, layout, rc, same, steps, warmup)
    print("quartets: two consecutive step pairs, which ran in opposite orders (A B then B A), as one ratio "
          "(A_i + A_i+1) / (B_i + B_i+1) - 1, so that a drift linear over the four steps cancels; main-thread CPU: the "
          "same on the slowest rank's compute-thread CPU seconds (no receive or scheduler waits)")
    print("overhead: median of the time-adjacent step pairs (attnres_i / standard_i - 1); ratio: AttnRes relative to "
          "the standard residual of the same layout and recompute setting; saved = bytes a micro-batch's forward "
          "keeps for its backward (rank's chunks summed, worst rank).")


if __name__ == "__main__":
    main()
