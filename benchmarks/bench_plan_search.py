"""How fast ``k3train plan`` answers, and how good its answer is (issue 46): per case, the default plan with a cold
memory cache (its own empty ``K3TRAIN_CACHE_DIR``) and again warm (the same directory), its chosen layout and
predicted step, whether it is proven best, and the complete search's best (``tools/plan.py --complete``: no
budget, bounds prune, nothing else; in a cold cache of its own) and its wall time.

    .venv/bin/python benchmarks/bench_plan_search.py                      # the five cases (an idle 2-core machine)
    .venv/bin/python benchmarks/bench_plan_search.py --cases small-8,tiny-4 --complete-timeout-s 600

The cpu case (tiny at world 4) is calibrated once, first, into the benchmark's own calibration file, which every
plan of it then reads (the cold/warm difference is the memory cache, not the host's calibration). Each plan runs in
its own process (``--json``: its status, chosen layout and seconds); a plan over ``--timeout-s`` (or a complete
search over ``--complete-timeout-s``) is reported as not finished. Figures are for an idle machine: other work
slows the searches and, for the cpu case, discards its calibration.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K3_4K = ("--train.seq_len=4096", "--train.global_batch_size=4096")
CASES = {
    "k3-4k": ("configs/k3.yaml", 2048, "h200", K3_4K),
    "k3-1m-2048": ("configs/k3.yaml", 2048, "h200", ()),
    "k3-1m-8192": ("configs/k3.yaml", 8192, "h200", ()),
    "small-8": ("configs/small.yaml", 8, "h100", ()),
    "tiny-4": ("configs/tiny.yaml", 4, "cpu", ()),
}


def plan(case: str, cache: Path, calibration: Path, extra: list[str], timeout: float) -> dict:
    """One ``tools/plan.py --json`` run of ``case`` with ``cache`` as its k3train cache directory: its JSON (with
    ``wall_s``), or ``{"error": ...}``."""
    config, world, device, over = CASES[case]
    cmd = [sys.executable, str(ROOT / "tools" / "plan.py"), "--config", config, "--world-size", str(world),
           "--device", device, "--calibration", str(calibration), "--json", *over, *extra]
    env = {**os.environ, "K3TRAIN_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"not finished in {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1], "wall_s": wall}
    out = json.loads(p.stdout)
    out["wall_s"] = wall
    return out


def summary(out: dict) -> str:
    """A plan's result in one line: wall time, chosen layout and step, proven or not."""
    if "error" in out:
        return f"{out['wall_s']:7.1f} s  {out['error']}"
    ch, st = out.get("chosen"), out["status"]
    lay = _short(ch["layout"]) if ch else "none fits"
    step = f"{ch['predicted_step_s']:.4g} s" if ch else "-"
    how = "proven" if st["proven"] else f"best so far ({st['stopped_by'] or 'ended'}; {st['left']} left)"
    return f"{out['wall_s']:7.1f} s  {lay:<44} {step:>10}  {how}"


def _short(lay: dict) -> str:
    s = f"pp{lay['pp']}" + (f"v{lay['vpp']}" if lay["vpp"] > 1 else "")
    s += f" dp{lay['dp']} cp{lay['cp']} ep{lay['ep']}{'M' if lay['moonep'] else ''} z{lay['zero']} mb{lay['mbs']}"
    return s + (" rc" if lay["recompute"] else "") + f" {lay['schedule']}" + (" paired" if lay["overlap_ep"] else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="a default plan's limit")
    ap.add_argument("--complete-timeout-s", type=float, default=7200.0, help="a complete search's limit")
    ap.add_argument("--no-complete", action="store_true", help="skip the complete searches")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        print(f"bench_plan_search: unknown case {bad[0]!r} (of {', '.join(CASES)})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="k3plan_bench_") as tmp:
        tmp_path = Path(tmp)
        calibration = tmp_path / "cpu_calibration.json"
        if "tiny-4" in cases:  # the host's calibration once, outside every timed plan
            plan("tiny-4", tmp_path / "calibrate", calibration, ["--top", "1"], args.timeout_s)
        print(f"{'case':<11} {'run':<9} {'wall':>9}  {'chosen':<44} {'step':>10}  proof")
        for case in cases:
            cache = tmp_path / f"{case}-cache"
            for run in ("cold", "warm"):
                print(f"{case:<11} {run:<9} {summary(plan(case, cache, calibration, [], args.timeout_s))}",
                      flush=True)
            if not args.no_complete:
                out = plan(case, tmp_path / f"{case}-complete", calibration, ["--complete", "--top", "1"],
                           args.complete_timeout_s)
                print(f"{case:<11} {'complete':<9} {summary(out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
