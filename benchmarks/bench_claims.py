"""The documented performance and accuracy figures as claims `make bench` (benchmarks/bench_readme.py) re-measures:
the one place that says which figure, where it is stated, its tolerance, and which tool invocation measures it.

Each :class:`Run` is one tool invocation (arguments chosen so that all of them together take about 30 minutes on
an idle 2-core machine; ``expected_s`` is that estimate, ``timeout_s`` its limit) and a parser of the tool's
printed output. Each :class:`Claim` names the run that measures it, the file that states the figure (``file``: a
docs page or a dated results file under benchmarks/results/) and the text it states it in (``text``: it must
appear in that file, checked by tests/tools/test_bench_readme.py), and the bound a measurement on another host
must meet. Where the stated figure was taken on one particular host, the bound is the ratio that transfers (a
speed-up, a fraction of the host's own matmul rate, an error), not the seconds.

Parsers read the lines the tools print for people (or their ``--json`` where they have one) and raise
:class:`ParseError` naming the line they did not find, so a tool whose output changed fails loudly here.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Callable


class ParseError(ValueError):
    """A tool's output lacks the line a claim is read from."""


@dataclass(frozen=True)
class Measure:
    value: float        # compared with the claim's bound
    text: str           # as printed in the table, e.g. "2.91x"
    detail: str = ""    # what else the tool said that bears on it
    matmul_gflops: float = math.nan  # the one-thread matmul rate the tool measured beside it, if it did


@dataclass(frozen=True)
class Run:
    name: str
    argv: tuple[str, ...]       # after the interpreter; "{tmp}" is this run's own temporary directory
    conditions: str
    expected_s: int             # on an idle 2-core machine
    timeout_s: int
    parse: Callable[[str], dict[str, Measure]]
    ok_exit: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class Claim:
    key: str
    run: str
    figure: str
    stated: str                 # the figure as the docs state it
    op: str                     # ">=" or "<="
    bound: float
    unit: str                   # appended to numbers: "x", "%", " ms", ""
    file: str                   # the file that states it (relative to the repository root)
    text: str                   # the text of ``file`` that states it
    fast_matmul_bound: float | None = None  # the bound on a host whose matmul is faster than FAST_MATMUL_GFLOPS

    def bound_for(self, matmul_gflops: float) -> float:
        fast = self.fast_matmul_bound is not None and matmul_gflops > FAST_MATMUL_GFLOPS
        return self.fast_matmul_bound if fast else self.bound  # type: ignore[return-value]

    def claimed(self, matmul_gflops: float) -> str:
        return f"{self.stated}; {self.op} {self.bound_for(matmul_gflops):g}{self.unit}"

    def within(self, value: float, matmul_gflops: float) -> bool:
        b = self.bound_for(matmul_gflops)
        return math.isfinite(value) and (value >= b if self.op == ">=" else value <= b)


# The KDA fraction of matmul FLOP/s (benchmarks/results/kda.md): 45.6% beside a 33.5 GFLOP/s one-thread matmul,
# 34.6-41.8% beside 81-88 GFLOP/s ones, where the op's own small batched GEMMs reach only 59-73% of the big matmul:
# the fraction falls as the big matmul gets faster, so its bound depends on the matmul rate measured beside it.
FAST_MATMUL_GFLOPS = 60.0


# ---------------------------------------------------------------------------------------------------------------
# parsers: stdout of one run -> {claim key: Measure}
# ---------------------------------------------------------------------------------------------------------------
def _num(cell: str) -> float:
    return float(cell.rstrip("x%"))


def parse_kda(out: str) -> dict[str, Measure]:
    """benchmarks/bench_kda.py: the row ``T=4096, K=V=128`` (14 cells: T, K=V, new ms, autograd, naive ms, vs auto,
    vs naive, GFLOP, mm GF/s, new/mm, auto/mm, saved new, saved auto, max|do|)."""
    for line in out.splitlines():
        c = line.split()
        if len(c) == 14 and c[0] == "4096" and c[1] == "128":
            ms = f"new {c[2]} ms, autograd {c[3]} ms"
            return {"kda_speedup": Measure(_num(c[5]), c[5], ms),
                    "kda_matmul_fraction": Measure(_num(c[9]), c[9], f"{float(c[8]):.1f} GFLOP/s matmul beside "
                                                   "the row", matmul_gflops=float(c[8])),
                    "kda_saved": Measure(_num(c[11]), c[11], f"autograd op {c[12]}")}
    raise ParseError("bench_kda: no row for T=4096, K=V=128")


_ATTNRES = re.compile(r"^(\S+)\s+(off|on)\s+attnres\s+\|\s+([\d.]+)\s+([+-]?[\d.]+)%\s+\|")


def parse_attnres(out: str) -> dict[str, Measure]:
    """benchmarks/bench_attnres.py: the ``attnres`` row's overhead (median of time-adjacent step pairs), with its
    pairs' range and the quartets beside it."""
    for line in out.splitlines():
        m = _ATTNRES.match(line)
        if m:
            extra = line.split("pairs ", 1)[1].strip() if "pairs " in line else ""
            return {"attnres_overhead": Measure(float(m.group(4)), f"{float(m.group(4)):+.1f}%",
                                                f"{m.group(1)} recompute {m.group(2)}, step {m.group(3)} s; "
                                                f"pairs {extra}")}
    raise ParseError("bench_attnres: no 'attnres' row")


def _rows(pattern: re.Pattern, out: str, what: str) -> list[tuple[str, ...]]:
    """The groups of every line of ``out`` that ``pattern`` matches (ParseError naming ``what`` if none)."""
    rows = [m.groups() for m in map(pattern.match, out.splitlines()) if m]
    if not rows:
        raise ParseError(f"{what}: no rows")
    return rows


_LAYOUT = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+(\d+)\s+\|\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\|\s+([\d.]+)\s+\|")


def parse_moonep_layout(out: str) -> dict[str, Measure]:
    """benchmarks/bench_moonep.py layout: the slowest row's plan + layout ms (the ``fast`` column)."""
    rows = _rows(_LAYOUT, out, "bench_moonep layout")
    worst = max(rows, key=lambda r: float(r[3]))
    host = re.search(r"host: sum\(range\(1000\)\) ([\d.]+) us", out)
    return {"moonep_plan_ms": Measure(float(worst[3]), f"{float(worst[3]):.2f} ms",
                                      f"worst of {len(rows)} rows at {worst[0]} tokens/rank, alpha {worst[1]}"
                                      + (f"; host sum(range(1000)) {host.group(1)} us" if host else ""))}


_MEMROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+\|\s+(-?\d+)\s+\|\s+(-?\d+)\s+\|\s+(\d+)\s+\|\s+(\d+)\s+\|\s+(\d+)\s*$")


def parse_moonep_memory(out: str) -> dict[str, Measure]:
    """benchmarks/bench_moonep.py memory: MoonEP's extra bytes (held after the forwards and at the backward's peak,
    MoonEP minus plain EP) at every MoE depth and micro-batches in flight, as a fraction of its two-bank replica
    pool: flat means bounded by the pool, where the old design's held bytes grow as layers x micro-batches."""
    rows = [tuple(map(int, r)) for r in _rows(_MEMROW, out, "bench_moonep memory")]
    pool = max(r[4] for r in rows)
    extra = max(max(r[2], r[3]) for r in rows)
    held = [r[2] for r in rows]
    depth = [r[0] * r[1] for r in rows]
    old = [r[6] for r in rows]
    return {"moonep_extra_flat": Measure(extra / pool, f"{extra / pool:.2f} pool",
                                         f"held extra {min(held) / 1024:.0f}..{max(held) / 1024:.0f} KiB at "
                                         f"layers x mbs {min(depth)}..{max(depth)}; pool {pool / 1024:.0f} KiB; "
                                         f"old design {min(old) / 1024:.0f}..{max(old) / 1024:.0f} KiB")}


_CKPT = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s*$")


def parse_checkpoint(out: str) -> dict[str, Measure]:
    """benchmarks/bench_checkpoint.py: sync stall / async stall, the smaller over the process counts."""
    rows = _rows(_CKPT, out, "bench_checkpoint")
    worst = min(rows, key=lambda r: float(r[6]))
    detail = "; ".join(f"{r[0]} proc: sync {r[3]} s, async {r[5]} s ({r[1]} MiB, step {r[2]} s)" for r in rows)
    return {"checkpoint_async": Measure(float(worst[6]), f"{float(worst[6]):.1f}x", detail)}


_PLAN = re.compile(r"median \|error\| ([\d.]+)%, worst ([\d.]+)%, Spearman (-?[\d.]+|nan) over (\d+) layouts")


def parse_plan(out: str) -> dict[str, Measure]:
    """tools/plan.py --measure: its summary line."""
    m = _PLAN.search(out)
    if not m:
        raise ParseError("plan: no 'median |error| ..., Spearman ...' line")
    med, worst, rho, n = float(m.group(1)), float(m.group(2)), float(m.group(3)), int(m.group(4))
    chosen = re.search(r"^chosen: (.+?)  \(", out, re.M)
    detail = f"worst {worst:.1f}% over {n} layouts" + (f"; chosen {chosen.group(1)}" if chosen else "")
    return {"planner_median_error": Measure(med, f"{med:.1f}%", detail),
            "planner_spearman": Measure(rho, f"{rho:.3f}", f"over {n} layouts")}


def _last_json(out: str) -> dict:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    raise ParseError("no JSON object on the last lines of the output")


def parse_memory(key: str) -> Callable[[str], dict[str, Measure]]:
    """tools/memory.py --measure --json: the largest |estimate - measured| / measured over the ranks."""
    def parse(out: str) -> dict[str, Measure]:
        ranks = _last_json(out).get("ranks", [])
        errs = [(r["rank"], 100 * (r["peak"] - r["measured_peak"]) / r["measured_peak"])
                for r in ranks if r.get("measured_peak")]
        if not errs:
            raise ParseError("memory: no rank with a measured peak")
        worst = max(abs(e) for _, e in errs)
        return {key: Measure(worst, f"{worst:.2f}%", ", ".join(f"rank {r} {e:+.2f}%" for r, e in errs))}
    return parse


def parse_vision(out: str) -> dict[str, Measure]:
    """benchmarks/bench_vision_learns.py --json: its verdict (``ok``) and the gap line it prints."""
    d = _last_json(out)
    if "ok" not in d:
        raise ParseError("bench_vision_learns: no 'ok' in its JSON")
    ok = bool(d["ok"])
    return {"vision_learns": Measure(1.0 if ok else 0.0, "pass" if ok else "FAIL", str(d.get("verdict", "")))}


# ---------------------------------------------------------------------------------------------------------------
# the runs and the claims
# ---------------------------------------------------------------------------------------------------------------
TINY_MEM = ("tools/memory.py", "--config", "configs/tiny.yaml", "--world-size", "2", "--measure", "--json")
RUNS: tuple[Run, ...] = (
    Run("kda", ("benchmarks/bench_kda.py", "--threads", "1", "--lengths", "4096", "--dims", "128", "--heads", "4",
                "--repeats", "5", "--naive-max-t", "1"),
        "T=4096, H=4, K=V=128, fp32, 1 thread, median of 5; naive reference skipped", 60, 300, parse_kda),
    Run("attnres", ("benchmarks/bench_attnres.py", "--config", "configs/small.yaml", "--layouts", "pp2vpp2",
                    "--recompute", "off", "--steps", "6", "--warmup", "1"),
        "configs/small.yaml, pp=2 x vpp=2 (2 processes), recompute off, 6 step pairs after 1", 330, 900,
        parse_attnres),
    Run("moonep_layout", ("benchmarks/bench_moonep.py", "layout"),
        "E=896, R=64, top-16, 1024 and 4096 tokens/rank, alpha 0/1/1.5, 1 thread, median of 20", 90, 300,
        parse_moonep_layout),
    Run("moonep_memory", ("benchmarks/bench_moonep.py", "memory"),
        "2 gloo ranks, E=8 top-2, 1/2/4 MoE layers x 1/2/4 micro-batches in flight, fp32", 30, 300,
        parse_moonep_memory),
    Run("checkpoint", ("benchmarks/bench_checkpoint.py",),
        "configs/small.yaml (94M parameters + optimizer state), 1 and 2 processes, median of 2", 240, 900,
        parse_checkpoint),
    Run("planner", ("tools/plan.py", "--config", "configs/tiny.yaml", "--world-size", "4", "--device", "cpu",
                    "--measure", "8", "--bottom", "3", "--calibration", "{tmp}/cpu_calibration.json"),
        "tiny at world 4, 8 fastest + 3 slowest layouts measured (6 steps), calibrated afresh", 1100, 2400,
        parse_plan),
    Run("memory_pp2vpp2", (*TINY_MEM, "--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_layers=[3,1,2,2]"),
        "tiny, world 2, pp=2 x vpp=2, layers [3,1,2,2], 3 measured steps", 75, 300,
        parse_memory("memory_pp2vpp2")),
    # unpaired (overlap_ep=false): under F/B pairing the peak depends on the two threads' timing (docs/planner.md)
    Run("memory_dp2ep2", (*TINY_MEM, "--parallel.dp=2", "--parallel.ep=2", "--parallel.zero=2",
                          "--parallel.moonep=true", "--parallel.overlap_ep=false"),
        "tiny, world 2, dp=2 ep=2 ZeRO-2 MoonEP, F/B pairing off, 3 measured steps", 75, 300,
        parse_memory("memory_dp2ep2")),
    Run("vision", ("benchmarks/bench_vision_learns.py", "--json"),
        "tiny-vl in one process, the tool's default corpus and steps", 180, 900, parse_vision, ok_exit=(0, 1)),
)

KDA, PLANNER, BENCH, ESTIMATOR = ("benchmarks/results/kda.md", "benchmarks/results/planner.md", "docs/benchmarks.md",
                                  "docs/planner.md")
CLAIMS: tuple[Claim, ...] = (
    Claim("kda_speedup", "kda", "KDA fwd+bwd speed-up over the autograd op", "2.86x", ">=", 2.0, "x", KDA,
          "2.86x the autograd op"),
    Claim("kda_matmul_fraction", "kda", "KDA op FLOP/s / 1-thread matmul FLOP/s",
          "45.6% at 33.5, 34.6-41.8% at 81-88 GF/s", ">=", 40.0, "%", KDA, "45.6% of matmul FLOP/s",
          fast_matmul_bound=34.0),
    Claim("kda_saved", "kda", "KDA autograd-saved / input bytes", "2.75x", "<=", 3.0, "x", KDA, "2.75x saved"),
    Claim("attnres_overhead", "attnres", "AttnRes step overhead vs standard residual", "goal", "<=", 5.0, "%", BENCH,
          "AttnRes step-time overhead <= 5%"),
    Claim("moonep_plan_ms", "moonep_layout", "MoonEP plan + layout per layer (E=896, R=64)", "goal", "<=", 2.0,
          " ms", BENCH, "MoonEP plan + layout <= 2 ms per layer"),
    Claim("moonep_extra_flat", "moonep_memory", "MoonEP extra bytes / two-bank pool, any depth", "flat", "<=", 1.0,
          "", BENCH, "MoonEP extra bytes per rank within its two-bank replica pool"),
    Claim("checkpoint_async", "checkpoint", "checkpoint stall: sync / async_save", "goal", ">=", 2.0, "x", BENCH,
          "an async_save stall at most half a synchronous one"),
    Claim("planner_median_error", "planner", "planner median |error|, tiny world 4", "5.5%", "<=", 15.0, "%",
          PLANNER, "median |error| 5.5%, worst 17.7%, Spearman 0.918 over 11 layouts"),
    Claim("planner_spearman", "planner", "planner Spearman rank correlation, tiny world 4", "0.918", ">=", 0.8, "",
          PLANNER, "median |error| 5.5%, worst 17.7%, Spearman 0.918 over 11 layouts"),
    Claim("memory_pp2vpp2", "memory_pp2vpp2", "memory estimate |error|, worst rank, pp2 vpp2 uneven",
          "-0.2%, -0.1%", "<=", 2.0, "%", ESTIMATOR, "within 2% of its measured peak"),
    Claim("memory_dp2ep2", "memory_dp2ep2", "memory estimate |error|, worst rank, dp2 ep2 z2 MoonEP", "within 2%",
          "<=", 2.0, "%", ESTIMATOR, "within 2% of its measured peak"),
    Claim("vision_learns", "vision", "vision path learns (image-word gap grows)", "pass", ">=", 1.0, "", BENCH,
          "does the vision path learn"),
)

RUN_BY_NAME = {r.name: r for r in RUNS}
