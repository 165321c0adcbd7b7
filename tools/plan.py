"""Which parallel layout trains fastest without running out of memory, and why (k3train/planning/search/).

    .venv/bin/python tools/plan.py --config configs/tiny.yaml --world-size 4 --device cpu --measure 8
    .venv/bin/python tools/plan.py --config configs/k3.yaml --world-size 2048 --device h200 --json --plot k3.png

Enumerates every layout (pp, vpp, dp, cp, ep, MoonEP, ZeRO, micro-batch size, recompute, schedule) that the run
validation accepts for the world size -- a ``--parallel.X=`` / ``--train.micro_batch_size=`` override pins that
dimension -- drops those whose estimated per-rank peak (tools/memory.py's estimator) exceeds the device memory,
predicts each step time with its breakdown (compute, exposed communication, bubble, optimizer) and prints the
ranking. ``--device`` is ``cpu`` (calibrated here, cached), ``h100`` / ``h200`` / ``b200`` / ``gb200`` / ``gb300``
(published figures) or a device file (YAML) of your cluster; ``--gpus-per-node``, ``--nvlink-domain`` and
``--internode-gbit-s`` describe the cluster on top of it (k3train/planning/calibration/cluster.py);
``--device-field FIELD=VALUE`` overrides any field (k3train/planning/calibration/devices.py). ``--json``: one object
with a ``layouts`` list. ``--plot F.png``: predicted throughput against peak memory, the chosen layout marked.
``--measure K``: the top K and a few of the slowest predicted layouts run for ``--steps`` real steps under torchrun
here; measured beside predicted, median absolute error and Spearman rank correlation.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3train.config import ConfigError, load_config  # noqa: E402 - after the path set-up above
from k3train.planning.calibration.cluster import cluster_flags  # noqa: E402
from k3train.planning.calibration.devices import check_device  # noqa: E402
from k3train.planning.scope import check_modelled  # noqa: E402
from k3train.runtime.bad_input import OneLineParser, is_bad_input, report_bad_input  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="tools/plan.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--device", default="cpu", help="cpu, h100, h200, b200, gb200, gb300, or a device file (.yaml: "
                                                     "k3train/planning/calibration/cluster.py)")
    ap.add_argument("--device-field", action="append", default=[], metavar="FIELD=VALUE")
    # the cluster, on top of the device (k3train/planning/calibration/cluster.py)
    ap.add_argument("--gpus-per-node", type=int, default=None)
    ap.add_argument("--nvlink-domain", type=int, default=None, help="GPUs one NVLink fabric joins (NVL72: 72)")
    ap.add_argument("--internode-gbit-s", type=float, default=None, help="scale-out NIC bandwidth per GPU, Gb/s")
    ap.add_argument("--calibration", default=None, help="cpu calibration cache (default ~/.cache/k3train/...)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--measure", type=int, default=0, metavar="K")
    ap.add_argument("--bottom", type=int, default=3, help="with --measure: slowest predicted layouts also run")
    ap.add_argument("--steps", type=int, default=6,
                    help="with --measure: steps per run (the first two excluded; the first only, below 5 steps)")
    ap.add_argument("--ep-skew", type=float, default=1.5, help="plain EP: busiest rank's routed load / mean")
    ap.add_argument("--exhaustive", action="store_true", help="simulate and trace every layout (small spaces)")
    ap.add_argument("--complete", action="store_true",
                    help="search without a budget until the best is proven (bounds prune, no heuristic skips): the "
                         "reference the default search is compared with")
    ap.add_argument("--exact-memory", action="store_true",
                    help="trace every ranked layout's exact peak (default: the chosen layout's; the others may be "
                         "ranked on an upper bound of their peak, '<=' in the table)")
    ap.add_argument("--no-cache", action="store_true",
                    help="neither read nor write the memory cache (traced pieces and estimates, in the k3train "
                         "cache directory)")
    ap.add_argument("--trace-budget-s", type=float, default=0.0,
                    help="seconds of memory traces at most (0: what --time-budget-s leaves)")
    ap.add_argument("--sim-budget-s", type=float, default=0.0,
                    help="seconds of schedule simulation at most (0: what --time-budget-s leaves)")
    ap.add_argument("--time-budget-s", type=float, default=60.0,
                    help="seconds of the whole plan at most (enumeration, bounds, simulation, traces; not --measure "
                         "nor the chosen layout's exact peak); when it ends first, the first line says so")
    ap.add_argument("--reference", default="", help="a layout to place in the ranking, as overrides "
                                                    "'--parallel.pp=16 --parallel.vpp=2 ...'")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default="")
    return ap


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731 - progress: stdout starts with the answer
    try:
        ref_over = _checked(args, overrides)
        run = _plan(args, overrides, log)
    except Exception as e:  # noqa: BLE001 - bad input is one line; anything else is a bug and raises
        if isinstance(e, (ConfigError, FileNotFoundError)) or is_bad_input(e):
            return report_bad_input(e)
        raise
    planner, res, lt, dev = run.planner, run.res, run.lt, run.dev
    ref_row = _place_reference(args, overrides, ref_over, planner, res)
    ranked = res.ranked()
    chosen = ranked[0] if ranked else None
    picks = _measure_picks(args, planner, res) if args.measure else []
    cal_note = _keep_calibration(run.cal_file, run.cal_before, run.others, lt) if dev.is_cpu else None
    if cal_note:
        res.notes.append(cal_note)
    if args.measure:
        _measure(args, overrides, picks, dev, log)
        ranked = res.ranked()  # the picks traced layouts the budget had left out: they compete too
        chosen = ranked[0] if ranked else None
    if chosen is not None:  # its exposed communication by kind, pipeline transfers included (one simulation more)
        chosen.pred = planner.predict(chosen, split_p2p=True)
    if args.plot:
        from k3train.planning.search.report import plot  # lazy: torch is not loaded before the config is checked

        plot(res, args.plot, chosen, ref_row)
    if args.json:
        print(json.dumps({"world_size": args.world_size, "device": _dev_json(res.device),
                          "status": {**res.status.as_json(), "line": status_line(res, chosen)},
                          "valid_layouts": res.layouts,
                          "candidates_checked": res.candidates, "seconds": res.seconds, "notes": res.notes,
                          "chosen": chosen.as_json(res.base_cfg, res.world, dev.peak_flops) if chosen else None,
                          "reference": ref_row.as_json(res.base_cfg, res.world, dev.peak_flops) if ref_row else None,
                          "layouts": [r.as_json(res.base_cfg, res.world, dev.peak_flops) for r in res.rows]}))
    else:
        _print_plan(args, planner, res, lt, ranked, chosen, ref_row)
    if args.measure:
        _print_measured(args, res)
    return 0


def _checked(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The command line and the base config checked before any work (ConfigError); the reference's overrides."""
    if args.world_size < 1:
        raise ConfigError(f"--world-size: must be >= 1, got {args.world_size}")
    for k, v in (("--top", args.top), ("--measure", args.measure), ("--steps", args.steps - 1)):
        if v < (1 if k != "--measure" else 0):
            raise ConfigError(f"{k}: out of range")
    for k, v in (("--time-budget-s", args.time_budget_s), ("--sim-budget-s", args.sim_budget_s),
                 ("--trace-budget-s", args.trace_budget_s)):
        if not v >= 0:
            raise ConfigError(f"{k}: must be >= 0 seconds, got {v}")
    if args.complete and args.exhaustive:
        raise ConfigError("--complete and --exhaustive: choose one (--exhaustive also traces every layout)")
    if args.ep_skew < 1:
        raise ConfigError(f"--ep-skew: must be >= 1 (max load / mean load), got {args.ep_skew}")
    check_device(args.device, args.device_field, cluster_flags(vars(args)))
    check_modelled(load_config(args.config, overrides))  # the base config itself (keys, types) before any work
    ref_over = args.reference.split() if args.reference else []
    if ref_over:
        load_config(args.config, overrides + ref_over, world_size=args.world_size)
    if args.plot:
        try:
            import matplotlib  # noqa: F401  # lazy: matplotlib is optional (only --plot needs it)
        except ImportError:
            raise ConfigError("--plot needs matplotlib (.venv/bin/pip install matplotlib)") from None
    return ref_over


class _Planned(NamedTuple):
    """A plan's planner and result, the device and layer timings it used, and what :func:`_keep_calibration` needs
    (the calibration file, its bytes before the plan, the other processes' CPU since)."""
    planner: Any
    res: Any
    dev: Any
    lt: Any
    cal_file: Path
    cal_before: bytes | None
    others: Any


def _plan(args: argparse.Namespace, overrides: list[str], log: Any) -> _Planned:
    """Enumerate, calibrate (cpu) and plan."""
    # lazy: torch is not loaded before the command line and the config are checked (bad input: one line, fast)
    from k3train.planning.calibration.devices import get_device
    from k3train.planning.calibration.host import cache_path  # lazy: as above
    from k3train.planning.calibration.host_busy import OthersCpu  # lazy: as above
    from k3train.planning.calibration.layer_times import LayerTimes  # lazy: as above
    from k3train.planning.search.planner import Planner  # lazy: as above
    from k3train.planning.search.space import enumerate_space  # lazy: as above

    t_enum = time.perf_counter()
    space = enumerate_space(args.config, overrides, args.world_size)
    t_enum = time.perf_counter() - t_enum
    if not space.cores:
        raise ConfigError(f"no valid layout of {args.config} for world size {args.world_size} (with the "
                          f"dimensions pinned on the command line: {' '.join(overrides) or 'none'})")

    if args.device.lower() != "cpu" and args.measure:
        raise ConfigError(f"--measure runs on this machine: it needs --device cpu, not {args.device}")
    cal_file = cache_path(args.calibration)
    cal_before = cal_file.read_bytes() if args.device.lower() == "cpu" and cal_file.exists() else None
    others = OthersCpu()  # a calibration taken beside other work is discarded (_keep_calibration)
    dev = get_device(args.device, args.world_size, args.device_field, args.calibration, log,
                     cluster_flags(vars(args)))

    lt = (LayerTimes(cache_path(args.calibration), dev.threads, log, config=args.config, overrides=overrides)
          if dev.is_cpu else None)
    if lt is not None:
        # how ranks slow each other down, measured on copies of this config's real one-process trainer (the
        # device-level small-op curve, and even the bare model's forward + backward, miss what a trainer step
        # shares the cores with: its loader, optimizer, bookkeeping and working set)
        curve = lt.concurrency(load_config(args.config, overrides), max(2, args.world_size) * dev.threads)
        dev = dataclasses.replace(dev, calibration={**dev.calibration, "concurrency": curve,
                                                    "concurrency_workload": "this config's trainer"})
    unbounded = args.complete or args.exhaustive
    planner = Planner(args.config, overrides, args.world_size, dev, top=max(args.top, args.measure),
                      skew=args.ep_skew, exhaustive=args.exhaustive, complete=args.complete, layer_times=lt,
                      trace_budget_s=args.trace_budget_s or math.inf, sim_budget_s=args.sim_budget_s or math.inf,
                      time_budget_s=math.inf if unbounded else args.time_budget_s, log=log, space=space,
                      store=not args.no_cache, exact_memory=args.exact_memory)
    planner.enum_s = t_enum
    res = planner.run()
    return _Planned(planner, res, dev, lt, cal_file, cal_before, others)


def _place_reference(args: argparse.Namespace, overrides: list[str], ref_over: list[str], planner: Any,
                     res: Any) -> Any:
    """The ``--reference`` layout's row, predicted and traced where the search skipped it (None: no reference, or
    not a layout of the space)."""
    if not ref_over:
        return None
    from k3train.planning.search.layouts import canonical  # lazy: torch is not loaded before the config is checked
    from k3train.planning.search.rows import Row  # lazy: as above

    ref_cfg = load_config(args.config, overrides + ref_over, world_size=args.world_size)
    ref_lay = canonical(ref_cfg)
    ref_row = next((r for r in res.rows if r.layout == ref_lay), None)
    if ref_row is None and res.layouts > len(res.rows):  # the search never made its row: it does now
        ref_row = Row(layout=ref_lay, cfg=ref_cfg, skipped="not examined")
        res.rows.append(ref_row)
    if ref_row is not None and ref_row.pred is None:
        ref_row.skipped = ""
        ref_row.pred = planner.predict(ref_row)
    if ref_row is not None and ref_row.peak_bytes is None and ref_row.fits is not False:
        planner.trace(ref_row)
    return ref_row  # a fitting reference competes like any traced layout


def _measure_picks(args: argparse.Namespace, planner: Any, res: Any) -> list[Any]:
    """What ``--measure`` runs: the fastest fitting layouts with distinct cores, and a few of the slowest."""
    from k3train.planning.search.select import distinct_top, slowest_fitting  # lazy: torch (after the config check)

    bottom = slowest_fitting(planner, res, args.bottom, _predict_one)
    top = distinct_top(planner, res, args.measure, _predict_one)
    return top + [r for r in bottom if r not in top]


def _measure(args: argparse.Namespace, overrides: list[str], picks: list[Any], dev: Any, log: Any) -> None:
    """Each pick's real step on this host (``--steps`` steps under torchrun), and how busy the host was meanwhile."""
    from k3train.planning.calibration.host_busy import OthersCpu  # lazy: torch (after the config check)
    from k3train.planning.calibration.measure_step import measure_step  # lazy: torch (after the config check)

    for r in picks:
        log(f"measuring {r.layout.short()} ({args.steps} steps) ...")
        run_others = OthersCpu()
        r.measured = measure_step(args.config, overrides + r.layout.overrides(), args.world_size, args.steps,
                                  dev.threads)
        r.measured["others_cores"] = run_others.cores()


def _print_plan(args: argparse.Namespace, planner: Any, res: Any, lt: Any, ranked: list[Any], chosen: Any,
                ref_row: Any) -> None:
    """The plan as text: the device, the anchor, the notes, the ranking (or the fastest if nothing fits), the
    reference's place, the chosen layout and the seconds each phase took."""
    from k3train.planning.search.report import format_table  # lazy: torch (after the config check)

    print(status_line(res, chosen))
    print(res.device.describe())
    anchor = lt.anchor(res.base_cfg) if lt is not None else None
    if anchor is not None:
        print(anchor.describe())
    for n in res.notes:
        print("note:", n)
    show = ranked[:args.top]
    if show:
        print(format_table(res, show))
    else:  # nothing fits: still show what is fastest, and how far from fitting
        fast = sorted((r for r in res.rows if r.pred is not None), key=lambda r: r.pred.step_s)[:args.top]
        none = "NO layout fits" if res.status.proven else "NO layout found yet to fit"
        print(f"{none} {res.device.hbm_bytes / 2**30:.1f} GiB; the fastest predicted ones (peak '-' = "
              f"not traced; memory lower bound {_lb(fast)}):")
        print(format_table(res, fast))
    if ref_row is not None:
        place = (ranked.index(ref_row) + 1) if ref_row in ranked else None
        sims = sorted(r.pred.step_s for r in res.rows if r.pred is not None)
        by_time = (sum(1 for x in sims if x < ref_row.pred.step_s) + 1) if ref_row.pred else None
        print(f"reference {ref_row.layout.short()}: " + (f"rank {place} of {len(ranked)} fitting" if place else
              f"fits={ref_row.fits}") + (f", predicted {ref_row.pred.step_s:.4g} s (place {by_time} of "
                                         f"{len(sims)} simulated by predicted time)" if ref_row.pred else ""))
        if ref_row not in show and ref_row.pred is not None and ref_row.peak_bytes is not None:
            print(format_table(res, [ref_row]).splitlines()[1])
        if ref_row.pred is not None:
            print(f"  {exposed_line(planner.predict(ref_row, split_p2p=True))}")
    if chosen is not None:
        print(f"chosen: {chosen.layout.short()}  ({' '.join(chosen.layout.overrides())})")
        print(f"  {exposed_line(chosen.pred)}")
    print(f"(planned in {res.seconds['total']:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                 res.seconds.items() if k != "total") + ")")


def _print_measured(args: argparse.Namespace, res: Any) -> None:
    """``--measure``: predicted beside measured per layout, the median error and the rank correlation, and whether
    they are within the documented accuracy (and the host was idle)."""
    from k3train.planning.calibration.host_busy import IDLE_OTHERS_CORES  # lazy: torch (after the config check)
    from k3train.planning.calibration.measure_step import spearman  # lazy: torch (after the config check)

    done = [r for r in res.rows if r.measured_step_s is not None]
    errs = sorted(abs(r.pred.step_s - r.measured_step_s) / r.measured_step_s for r in done)
    out = sys.stderr if args.json else sys.stdout
    print(f"{'layout':<40} {'predicted s':>11} {'measured s':>11} {'err':>7}   optimizer s: predicted / "
          f"measured (rank 0; its fwd+bwd, grad norm; predicted host work)", file=out)
    for r in sorted(done, key=lambda r: r.pred.step_s):
        e = (r.pred.step_s - r.measured_step_s) / r.measured_step_s
        m = {k: r.measured.get(k, float("nan")) for k in ("time_optimizer_s", "time_forward_backward_s",
                                                             "time_grad_norm_s")}
        ph = (f"   {r.pred.optimizer:.3f} / {m['time_optimizer_s']:.3f} "
              f"({m['time_forward_backward_s']:.3f}, {m['time_grad_norm_s']:.3f}; {r.pred.host:.3f})")
        busy = r.measured.get("others_cores", 0.0) > IDLE_OTHERS_CORES
        print(f"{r.layout.short():<40} {r.pred.step_s:11.4f} {r.measured_step_s:11.4f} {100 * e:+6.1f}%{ph}"
              + (f"   BUSY: other processes used {r.measured['others_cores']:.2f} cores" if busy else ""),
              file=out)
    rho = spearman([r.pred.step_s for r in done], [r.measured_step_s for r in done])
    med = errs[len(errs) // 2]
    print(f"median |error| {100 * med:.1f}%, worst {100 * errs[-1]:.1f}%, Spearman {rho:.3f} "
          f"over {len(done)} layouts", file=out)
    if med > DOCUMENTED_MEDIAN_ERROR or (len(done) > 2 and rho < DOCUMENTED_SPEARMAN):
        print(f"OVER THE DOCUMENTED ACCURACY (median |error| <= {100 * DOCUMENTED_MEDIAN_ERROR:.0f}%, Spearman >= "
              f"{DOCUMENTED_SPEARMAN}): the predicted step times above are not to be trusted on this host as "
              f"they stand (was the machine idle? {_load_line()})", file=out)
    n_busy = sum(r.measured.get("others_cores", 0.0) > IDLE_OTHERS_CORES for r in done)
    if n_busy:
        print(f"{n_busy} of {len(done)} measured runs had other processes using over {IDLE_OTHERS_CORES} cores "
              f"(BUSY above): their measured times, and so the errors, are not this host's", file=out)


def _keep_calibration(path: Path, before: bytes | None, others, lt) -> str | None:  # noqa: ANN001
    """After the plan (and the predictions of ``--measure``'s picks): if this run calibrated anything (the cache
    file changed) while other processes used over ``IDLE_OTHERS_CORES`` cores, put the file back as it was (the
    next plan measures again) and say so; else record the run's conditions in the file. None: nothing calibrated."""
    from k3train.planning.calibration.host import host_key, load_cache, save_cache  # lazy: torch (after the check)
    from k3train.planning.calibration.host_busy import IDLE_OTHERS_CORES  # lazy: torch (after the config check)

    if lt is not None:
        lt.save()
    now = path.read_bytes() if path.exists() else None
    if now == before:
        return None
    cores, wall = others.cores(), others.wall_s()
    if cores > IDLE_OTHERS_CORES:
        if before is None:
            path.unlink()
        else:
            path.write_bytes(before)
        return (f"CALIBRATION DISCARDED: other processes used {cores:.2f} cores on average while this host was "
                f"calibrated ({wall:.0f} s), so every timing of it, and every prediction above, is off; {path} is "
                f"as it was before: plan again on an idle machine")
    data = load_cache(path)
    runs = data.setdefault(host_key(lt.threads if lt is not None else 1), {}).setdefault("calibrated", [])
    runs.append({"time": time.strftime("%Y-%m-%d %H:%M"), "wall_s": round(wall, 1), "others_cores": round(cores, 3)})
    save_cache(path, data)
    return f"calibrated in this run ({wall:.0f} s): other processes used {cores:.2f} cores on average meanwhile"


# the accuracy the README states for --measure on an idle host (tiny and small configs, world 4)
DOCUMENTED_MEDIAN_ERROR = 0.15
DOCUMENTED_SPEARMAN = 0.8


def _load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} over 1 / 5 min on {os.cpu_count()} cores"


def _predict_one(planner, row, res):  # noqa: ANN001, ANN202 - select.py's prediction callback
    return planner.predict(row)


_KIND_NAMES = {"ep_all_to_all": "EP all-to-all", "moonep_replicas": "MoonEP replica transfers", "kcp": "KCP",
               "mla_cp": "MLA-CP", "grad_reduce": "gradient reduction", "zero_param_gather": "ZeRO parameter gather",
               "small_collectives": "small collectives"}


def exposed_line(pred) -> str:  # noqa: ANN001
    """The exposed communication of one prediction by kind, as shares of its step."""
    by = pred.detail["exposed_by_kind"]
    parts = [f"{_KIND_NAMES[k]} {100 * v / pred.step_s:.1f}%" for k, v in by.items() if v > 0]
    s = (f"exposed communication {100 * pred.exposed_comm / pred.step_s:.1f}% of the step: "
         + (", ".join(parts) or "none"))
    if "p2p_in_bubble_s" in pred.detail:
        s += f"; pipeline p2p {100 * pred.detail['p2p_in_bubble_s'] / pred.step_s:.1f}% (inside the bubble)"
    return s


def status_line(res, chosen) -> str:  # noqa: ANN001
    """The plan's first line: its answer, and whether it is proven best within the model or only the best so
    far (a budget ended the search: what was left that could still beat it)."""
    st = res.status
    name = (f"{chosen.layout.short()}, {chosen.pred.step_s:.4g} s a step" if chosen is not None else
            "no layout fits" if st.proven else "no layout found to fit yet")
    if st.proven:
        return (f"best: {name} -- proven best of the {res.layouts} layouts within the model (the rest cannot be "
                f"faster or does not fit)" if chosen is not None else
                f"no layout fits {res.device.hbm_bytes / 2**30:.1f} GiB -- proven over all {res.layouts} layouts")
    why = (f"the {st.stopped_by} ended the search" if st.stopped_by else "the search ended")
    left = (f"{st.left} layouts left whose step-time lower bound is below it"
            + (f" (from {st.lowest_left_s:.4g} s)" if st.lowest_left_s is not None else ""))
    heur = (f"; {st.heuristic} ruled out as needing more memory than a layout traced too big, untraced"
            if st.heuristic else "")
    cand = f"; the fastest candidate not decided: {st.candidate}" if st.candidate else ""
    return (f"BEST SO FAR, NOT PROVEN: {name}; {why}: {left}{heur}{cand} (raise --time-budget-s, or --complete)")


def _lb(rows) -> str:  # noqa: ANN001
    return ", ".join(f"{r.mem_bound / 2**30:.0f}" for r in rows[:5]) + " GiB ..." if rows else "-"


def _dev_json(dev) -> dict:  # noqa: ANN001
    from k3train.planning.calibration.devices import device_json  # lazy: torch (after the config check)

    return device_json(dev)


if __name__ == "__main__":
    sys.exit(main())
