"""The planner's absolute predictions against published GPU runs: every run of ``benchmarks/published/runs.yaml``
predicted at its nearest k3train layout (``k3train_nearest.flags``: the ``tools/plan.py`` flags of that layout),
term by term, beside the published tokens/s per GPU (docs/planner.md "Against published runs").

    .venv/bin/python benchmarks/bench_published.py               # the table and what explains each difference
    .venv/bin/python benchmarks/bench_published.py --markdown    # the same as a markdown table (the docs' one)
    .venv/bin/python benchmarks/bench_published.py --implied-eff # the compute efficiency each run's step needs
    .venv/bin/python benchmarks/bench_published.py --memory      # + each layout's memory estimate (traces: minutes)
    .venv/bin/python benchmarks/bench_published.py --json

Deterministic: the step-time model only (``k3train.planning.pinned.predict_pinned``), no timing of this machine.
Each row: the predicted step and tokens/s/GPU, MFU (the trainer's FLOP count over the bf16 peak), the published
figure, their ratio (predicted / published: above 1, k3train predicted faster), whether the run's runtime is
k3train's (``runtime_match``: BF16 and NCCL's all-to-all), the terms of the prediction on its critical pipeline
rank (compute, exposed EP all-to-all, exposed DP / ZeRO reduction and parameter gather, the bubble with the
pipeline's p2p share, the optimizer) and what explains the difference. For a run whose dispatcher is DeepEP's
(``dispatch``), the same prediction with the EP all-to-all's exposed seconds scaled to the rows DeepEP moves: one
per token and destination NVLink domain over the NIC, one per token and destination rank over NVLink, under the
run's routing (``consecutive``: NeMo AutoModel's balanced gate, a token's k experts consecutive; ``uniform``: k
distinct experts at random) -- k3train's NCCL all-to-all moves one row per route (k per token); for a schedule that
hides the all-to-all (``hidden``: DualPipe), the prediction without it (the table's last column: its ratio).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, NamedTuple

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3train.config import load_config  # noqa: E402
from k3train.model.flops import model_flops_per_token  # noqa: E402
from k3train.planning.calibration.cluster import cluster_flags  # noqa: E402
from k3train.planning.calibration.devices import check_device  # noqa: E402
from k3train.planning.memory.cache import EstimateCache  # noqa: E402
from k3train.planning.memory.estimate import estimate  # noqa: E402
from k3train.planning.pinned import predict_pinned  # noqa: E402
from k3train.planning.step_time.device import Device  # noqa: E402

RUNS_YAML = ROOT / "benchmarks" / "published" / "runs.yaml"
WITHIN = 0.20  # the goal for runs whose runtime k3train matches (issue 46)


class Pinned(NamedTuple):
    """A run's nearest layout, as tools/plan.py flags: the config with its overrides, the world, the device."""
    config: str
    overrides: list[str]
    world: int
    device: Device
    skew: float


def parse_flags(flags: str) -> Pinned:
    """``k3train_nearest.flags`` -> :class:`Pinned` (the device options as tools/plan.py reads them)."""
    ap = argparse.ArgumentParser(add_help=False)
    for name, tp in (("--config", str), ("--world-size", int), ("--device", str), ("--ep-skew", float),
                     ("--gpus-per-node", int), ("--nvlink-domain", int), ("--internode-gbit-s", float)):
        ap.add_argument(name, type=tp, default=None)
    ap.add_argument("--device-field", action="append", default=[])
    args, overrides = ap.parse_known_args(shlex.split(flags))
    cwd_free = str(ROOT / args.device) if args.device.endswith((".yaml", ".yml")) else args.device
    dev = check_device(cwd_free, args.device_field, cluster_flags(vars(args)))
    return Pinned(str(ROOT / args.config), overrides, args.world_size, dev,
                  args.ep_skew if args.ep_skew is not None else 1.5)


def load_runs(path: Path = RUNS_YAML) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())["runs"]


def deepep_share(cfg: Any, lay: Any, dev: Device, routing: str) -> float:
    """The seconds DeepEP's dispatch takes on the all-to-all's bottleneck link over what k3train's NCCL all-to-all
    takes there, for one EP group at the start of the world (module docstring)."""
    m = cfg.model
    E, k, ep = m.num_experts, m.num_experts_per_token, lay.ep
    per_rank, size = E // ep, dev.domain_size
    dom = [r // size for r in range(ep)]
    n_dom = len(set(dom))
    per_dom = E // n_dom if n_dom else E

    def rows(src: int, experts: list[int]) -> tuple[float, float]:  # (over NVLink, over the NIC)
        ranks = {e // per_rank for e in experts}
        return (len({r for r in ranks if dom[r] == dom[src] and r != src}),
                len({dom[r] for r in ranks if dom[r] != dom[src]}))

    if routing == "consecutive":
        period = E // math.gcd(E, k)
        pairs = [rows(s, [(t * k + j) % E for j in range(k)]) for s in range(ep) for t in range(period)]
        intra = statistics.fmean(p[0] for p in pairs)
        inter = statistics.fmean(p[1] for p in pairs)
    elif routing == "uniform":  # the expected distinct destinations of k experts drawn without replacement
        miss_rank = math.comb(E - per_rank, k) / math.comb(E, k)
        miss_dom = math.comb(E - per_dom, k) / math.comb(E, k)
        intra = (dom.count(dom[0]) - 1) * (1 - miss_rank)
        inter = (n_dom - 1) * (1 - miss_dom)
    else:
        raise ValueError(f"dispatch routing {routing!r}: expected consecutive or uniform")
    nv, nic = dev.link(True)[1], dev.link(False)[1]
    mine = dom.count(dom[0])
    nccl = max(k * (mine - 1) / ep / nv, k * (ep - mine) / ep / nic)
    return max(intra / nv, inter / nic) / nccl if nccl > 0 else 1.0


def predict_run(run: dict[str, Any], compute_eff: float | None = None, split_p2p: bool = True) -> dict[str, Any]:
    """One run's row: its prediction at the nearest layout, term by term, against the published figure
    (``split_p2p``: with the pipeline's p2p share of the bubble, one simulation more; else it is None)."""
    near = run["k3train_nearest"]
    p = parse_flags(near["flags"])
    dev = p.device if compute_eff is None else dataclasses.replace(p.device, compute_eff=compute_eff)
    cfg = load_config(p.config, p.overrides, world_size=p.world)
    lay, pred = predict_pinned(cfg, p.world, dev, p.skew, split_p2p)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    tps = tokens / pred.step_s / p.world
    published = run["compare"]["tokens_per_s_per_gpu"]
    by = pred.detail["exposed_by_kind"]
    row = {"id": run["id"], "model": run["model"], "gpus": p.world, "device": dev.name, "layout": lay.short(),
           "precision": run["compare"]["precision_class"], "runtime_match": bool(near["runtime_match"]),
           "step_s": pred.step_s, "tokens_per_s_per_gpu": tps,
           "mfu": model_flops_per_token(cfg.model, cfg.train.seq_len) * tps / dev.peak_flops,
           "published": published, "ratio": tps / published,
           "terms": {"compute": pred.compute, "ep_all_to_all": by["ep_all_to_all"],
                     "dp_zero": by["grad_reduce"] + by["zero_param_gather"] + by["small_collectives"],
                     "bubble": pred.bubble, "p2p_in_bubble": pred.detail.get("p2p_in_bubble_s"),
                     "optimizer": pred.optimizer},
           "unmatched": near.get("unmatched", []), "note": near.get("explain", "")}
    disp = near.get("dispatch")
    if disp:  # the run's dispatch: its bytes (and, hidden by its schedule, none of its time) in place of k3train's
        share = 0.0 if disp.get("hidden") else deepep_share(cfg, lay, dev, disp["routing"])
        step = pred.step_s - by["ep_all_to_all"] * (1 - share)
        row["deepep"] = {"kind": disp["kind"], "routing": disp.get("routing", ""), "share": share,
                         "hidden": bool(disp.get("hidden")), "ep_all_to_all": by["ep_all_to_all"] * share,
                         "step_s": step, "tokens_per_s_per_gpu": tokens / step / p.world,
                         "ratio": tokens / step / p.world / published}
    return row


def explain(row: dict[str, Any]) -> str:
    """What explains the row's difference: the runtime's differences from k3train's, the DeepEP what-if, the note."""
    parts = [] if row["runtime_match"] else ["differs: " + "; ".join(row["unmatched"])]
    if row["runtime_match"] and row["unmatched"]:
        parts.append("k3train's runtime but: " + "; ".join(row["unmatched"]))
    d = row.get("deepep")
    if d:
        how = (f"hides the EP all-to-all ({row['terms']['ep_all_to_all']:.1f} s)" if d["hidden"] else
               f"({d['routing']} routing) moves {d['share']:.2f} of k3train's all-to-all time: EP all-to-all "
               f"{row['terms']['ep_all_to_all']:.1f} -> {d['ep_all_to_all']:.1f} s")
        parts.append(f"{d['kind']} {how}: {d['tokens_per_s_per_gpu']:,.0f} tok/s/GPU (ratio {d['ratio']:.2f})")
    if row["note"]:
        parts.append(" ".join(str(row["note"]).split()))
    return ". ".join(parts)


HEAD = ("run", "GPUs", "device", "layout", "pred tok/s/GPU", "MFU", "published", "ratio", "match", "compute s",
        "EP a2a s", "DP/ZeRO s", "bubble s (p2p)", "opt s", "its dispatch: ratio")


def cells(row: dict[str, Any]) -> list[str]:
    t = row["terms"]
    ok = "" if not row["runtime_match"] else (" ok" if abs(row["ratio"] - 1) <= WITHIN else " MISS")
    p2p = f" ({t['p2p_in_bubble']:.2f})" if t["p2p_in_bubble"] is not None else ""
    return [row["id"], str(row["gpus"]), row["device"], row["layout"], f"{row['tokens_per_s_per_gpu']:,.0f}",
            f"{100 * row['mfu']:.1f}%", f"{row['published']:,}", f"{row['ratio']:.2f}",
            ("yes" if row["runtime_match"] else "no") + ok, f"{t['compute']:.2f}", f"{t['ep_all_to_all']:.2f}",
            f"{t['dp_zero']:.2f}", f"{t['bubble']:.2f}{p2p}", f"{t['optimizer']:.2f}",
            f"{row['deepep']['ratio']:.2f}" if "deepep" in row else "-"]


def format_table(rows: list[dict[str, Any]], markdown: bool) -> str:
    """The rows as an aligned text table (or a markdown one), then what explains each."""
    body = [cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(HEAD) + " |", "|" + "|".join("---" for _ in HEAD) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in body]
    else:
        width = [max(len(x) for x in col) for col in zip(HEAD, *body)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(line, width)).rstrip() for line in [list(HEAD), *body]]
    lines.append("")
    lines += [f"{'- ' if markdown else ''}{r['id']}: {explain(r)}" for r in rows]
    return "\n".join(lines)


def implied_eff(run: dict[str, Any]) -> float:
    """The ``compute_eff`` at which the run's prediction (its DeepEP what-if where it has one) meets its published
    tokens/s/GPU (bisection; 1.0: not even at the peak)."""
    lo, hi = 0.02, 1.0

    def tps(eff: float) -> float:
        row = predict_run(run, eff, split_p2p=False)
        return row["deepep"]["tokens_per_s_per_gpu"] if "deepep" in row else row["tokens_per_s_per_gpu"]

    target = run["compare"]["tokens_per_s_per_gpu"]
    if tps(hi) < target:
        return hi
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if tps(mid) > target else (mid, hi)
    return (lo + hi) / 2


def print_implied(runs: list[dict[str, Any]]) -> None:
    """Per run, the compute efficiency its published step needs; the median over the calibration set (the runs
    whose dispatch bytes are known: AutoModel's balanced gate) and over the runs whose runtime is k3train's."""
    effs = {r["id"]: implied_eff(r) for r in runs}
    for r in runs:
        print(f"{r['id']:<60} {effs[r['id']]:.3f}")
    calib = [effs[r["id"]] for r in runs
             if (r["k3train_nearest"].get("dispatch") or {}).get("routing") == "consecutive"]
    match = [effs[r["id"]] for r in runs if r["k3train_nearest"]["runtime_match"]]
    print(f"median over the {len(calib)} runs of AutoModel's balanced gate (the calibration): "
          f"{statistics.median(calib):.3f} (range {min(calib):.3f}-{max(calib):.3f}); over the {len(match)} runs "
          f"of k3train's runtime: {statistics.median(match):.3f}")


def memory_of(run: dict[str, Any]) -> str:
    """The layout's worst-rank memory estimate (tools/memory.py's) against the device; when it does not fit and
    does not recompute, its recompute twin's too, with that twin's prediction (k3train's nearest layout that may)."""
    p = parse_flags(run["k3train_nearest"]["flags"])
    cfg = load_config(p.config, p.overrides, world_size=p.world)

    def peak_of(c: Any) -> tuple[float, str]:
        peak = max(x.peak for x in estimate(c, p.world, EstimateCache()).ranks)
        return peak, f"{peak / 2**30:.1f} GiB of {p.device.hbm_bytes / 2**30:.1f}"

    peak, said = peak_of(cfg)
    if peak <= p.device.hbm_bytes:
        return said + " (fits)"
    if cfg.parallel.recompute:
        return said + " (too big)"
    twin = load_config(p.config, p.overrides + ["--parallel.recompute=true"], world_size=p.world)
    twin_peak, twin_said = peak_of(twin)
    tps = twin.train.global_batch_size * twin.train.seq_len / predict_pinned(twin, p.world, p.device, p.skew,
                                                                             False)[1].step_s / p.world
    fits = "fits" if twin_peak <= p.device.hbm_bytes else "too big"
    return (f"{said} (too big); with full recompute {twin_said} ({fits}), {tps:,.0f} tok/s/GPU "
            f"(ratio {tps / run['compare']['tokens_per_s_per_gpu']:.2f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/bench_published.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=str(RUNS_YAML))
    ap.add_argument("--only", default="", help="comma-separated run ids (default: every run)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--implied-eff", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    runs = load_runs(Path(args.runs))
    if args.only:
        runs = [r for r in runs if r["id"] in args.only.split(",")]
    if args.implied_eff:
        print_implied(runs)
        return 0
    rows = [predict_run(r) for r in runs]
    if args.memory:
        for run, row in zip(runs, rows):
            row["memory"] = memory_of(run)
            row["note"] = f"memory {row['memory']}. {row['note']}".strip()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(format_table(rows, args.markdown))
    match = [r for r in rows if r["runtime_match"]]
    inside = sum(abs(r["ratio"] - 1) <= WITHIN for r in match)
    print(f"\n{inside} of the {len(match)} runs whose runtime is k3train's within {100 * WITHIN:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
