"""Memory per pipeline stage and rank: estimated by running the real code on fake tensors, optionally measured.

    .venv/bin/python tools/memory.py --config configs/tiny.yaml --world-size 4 --parallel.pp=2 --parallel.vpp=2
    .venv/bin/python tools/memory.py --config configs/k3.yaml --world-size 8192 --parallel.pp=16 ... --json
    .venv/bin/python tools/memory.py --config configs/tiny.yaml --world-size 2 --parallel.pp=2 --measure
    .venv/bin/python tools/memory.py --config configs/tiny.yaml --world-size 4 --parallel.cp=4 \
        --train.seq_len=8192 --model.max_position_embeddings=8192 --train.micro_batch_size=1 --check-compose

Prints one row per rank (GiB per category: params, grads, optimizer, activations at the peak, comm buffers, peak
and where it happens; the worst rank per stage when a stage has more than 8 ranks). A vision model's first stage
traces the encoder on ``--media``: ``worst`` (every position of the micro-batch a placeholder of the largest
images the config allows, ``--media-frames`` per media), ``data`` (the run's own media) or ``none``; the default
``auto`` is ``worst`` on multimodal data and ``none`` on text data.
``--json`` prints one object with a ``ranks`` list of ``{rank, pp_rank, dp_rank, cp_rank, ep_rank, params, grads,
optimizer, activations, buffers, peak}`` in bytes (``measured_peak`` with ``--measure``). ``--plot F.png``: a
stacked bar per pipeline stage (its worst rank). ``--measure`` runs ``--steps`` real training steps of the same
config and layout with torchrun on this machine (k3train.planning.calibration.measure_memory) and reports the measured
peak of live tensor bytes beside the estimate. What is traced and what is computed: k3train/planning/memory/.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3train.config import ConfigError, load_config  # noqa: E402 - after the path set-up above
from k3train.planning.scope import check_modelled  # noqa: E402
from k3train.runtime.bad_input import report_bad_input  # noqa: E402


def run_measure(config: str, world: int, overrides: list[str], steps: int, timeout: float = 1800) -> dict[int, int]:
    """Measured peak live tensor bytes per rank (real training steps under torchrun)."""
    with tempfile.TemporaryDirectory(prefix="k3mem_") as tmp:
        from k3train.planning.calibration.host import child_env  # lazy: it loads torch; only --measure needs it

        env = child_env(ROOT, os.environ.get("OMP_NUM_THREADS", "1"))
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", f"--nproc_per_node={world}", "-m",
               "k3train.planning.calibration.measure_memory", "--config", config, "--out", tmp, "--steps", str(steps),
               *overrides]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"measure run failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
        out = {}
        for f in Path(tmp).glob("rank*.json"):
            rec = json.loads(f.read_text())
            out[rec["rank"]] = rec["cuda_max_allocated"] or rec["peak"]
        return out


def plot(est, path: str) -> None:  # noqa: ANN001 - an Estimate
    import matplotlib  # lazy: matplotlib is optional (only --plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional (only --plot needs it)

    from k3train.planning.memory.results import CATEGORIES  # lazy: torch is not loaded before the config is checked

    worst = {}
    for r in est.ranks:
        if r.pp_rank not in worst or r.peak > worst[r.pp_rank].peak:
            worst[r.pp_rank] = r
    stages = sorted(worst)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(stages) + 3), 4.5))
    bottom = [0.0] * len(stages)
    for c in CATEGORIES:
        vals = [getattr(worst[s], c) / 2**30 for s in stages]
        ax.bar([str(s) for s in stages], vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    meas = [worst[s].measured_peak for s in stages]
    if all(m is not None for m in meas):
        ax.scatter([str(s) for s in stages], [m / 2**30 for m in meas], color="k", marker="_", s=400,
                   label="measured peak", zorder=3)
    ax.set_xlabel("pipeline rank (worst rank of the stage)")
    ax.set_ylabel("GiB")
    ax.set_title(est.layout.split(";")[0], fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/memory.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default="")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--steps", type=int, default=3, help="with --measure: real steps (peak from step 2 on)")
    ap.add_argument("--check-compose", action="store_true",
                    help="compare the per-layer composition (used for long sequences) with whole-chunk traces")
    ap.add_argument("--media", choices=("auto", "worst", "data", "none"), default="auto",
                    help="vision models: what the first stage's encoder is traced on -- the worst case (every "
                         "position a placeholder of the largest images the config allows), the data's own media "
                         "(what --measure runs), or none; auto (default): worst on multimodal data, else none")
    ap.add_argument("--media-frames", type=int, default=1,
                    help="with --media worst: frames per media (1: images; up to vision.pos_emb_time: clips)")
    ap.add_argument("--all-ranks", action="store_true", help="print every rank (default: worst per stage "
                                                             "when a stage has more than 8)")
    ap.add_argument("--no-cache", action="store_true",
                    help="neither read nor write the memory cache (the traced pieces, shared with tools/plan.py, in "
                         "the k3train cache directory)")
    args, overrides = ap.parse_known_args(argv)
    # lazy: torch is not loaded before the command line is parsed (--help, a bad flag: fast)
    from k3train.planning.memory.media import MediaCase

    try:
        cfg = load_config(args.config, overrides, world_size=args.world_size)
        check_modelled(cfg)
        media = MediaCase(args.media, args.media_frames)
        media.check(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return report_bad_input(e)
    if args.plot:
        try:
            import matplotlib  # noqa: F401  # lazy: matplotlib is optional (only --plot needs it)
        except ImportError:
            return report_bad_input("--plot needs matplotlib (.venv/bin/pip install matplotlib)")
    if args.check_compose:
        from k3train.planning.memory.compose_check import compose_check  # lazy: torch (after the config check)

        rows = compose_check(cfg)
        for r in rows:
            err = [100 * (c - w) / w if w else 0.0 for w, c in zip(r["whole"], r["composed"])]
            print(f"stage {r['stage']} cp_rank {r['cp_rank']}: whole (saved, f_peak, b_peak) "
                  f"{[round(x / 2**20, 2) for x in r['whole']]} MiB, composed "
                  f"{[round(x / 2**20, 2) for x in r['composed']]} MiB, error {[f'{e:+.2f}%' for e in err]}")
        return 0
    from k3train.planning.memory.cache import EstimateCache  # lazy: torch (after the config check)
    from k3train.planning.memory.estimate import estimate  # lazy: torch (after the config check)
    from k3train.planning.memory.report import format_table  # lazy: torch (after the config check)
    from k3train.planning.memory.store import MemoryStore  # lazy: torch (after the config check)

    store = None if args.no_cache else MemoryStore(cfg)
    est = estimate(cfg, args.world_size, EstimateCache(store) if store is not None else None, media=media)
    if store is not None:
        store.save()
    if args.measure:
        measured = run_measure(args.config, args.world_size, overrides, args.steps)
        for r in est.ranks:
            r.measured_peak = measured.get(r.rank)
    if args.plot:
        plot(est, args.plot)
    if args.json:
        print(json.dumps(est.as_json()))
    else:
        print(format_table(est, args.all_ranks))
        print(f"(estimated in {est.seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
