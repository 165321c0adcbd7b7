"""``k3train plot RUN_DIR [RUN_DIR ...] -o FILE.png``: the per-step curves of one or more runs, overlaid.

Reads each run's ``metrics.jsonl`` (one JSON object per step, k3train/reporting/metrics.py) and ``config.yaml`` (the
resolved config the trainer writes), and draws loss (validation loss as markers), learning rate, grad norm,
tokens/s, MFU, MoE MaxVio and pipeline p2p bytes per step. Each run's legend entry is its directory name and
layout (``pp2 vpp2 dp1 cp1 ep1 zero1 muon``, plus the residual kind when the config has one), so two layouts,
Muon vs AdamW, or AttnRes vs the standard residual read side by side. Headless (matplotlib's Agg backend).
A panel whose metric no run logged says so instead of staying blank.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from k3train.runtime.bad_input import OneLineParser, report_bad_input

# (metrics.jsonl key, panel title)
PANELS = (("loss", "loss (markers: val_loss)"), ("lr", "learning rate"), ("grad_norm", "grad norm"),
          ("tokens_per_s", "tokens/s"), ("mfu", "MFU (%)"), ("moe_maxvio", "MoE MaxVio"),
          ("p2p_bytes", "p2p MiB per step"))
SCALE = {"mfu": 100.0, "p2p_bytes": 1 / 2**20}


class PlotError(ValueError):
    """A run directory that cannot be plotted (one line, exit 2)."""


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(records, config)`` of a run directory; a torn last line (a run killed mid-write) is skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (is it a run directory, train.out_dir of a run?)")
    records = []
    for ln in path.read_text().splitlines():
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            records.append(rec)
    if not records:
        raise PlotError(f"{path}: no step records")
    cfg: dict[str, Any] = {}
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        try:
            cfg = yaml.safe_load(cfg_path.read_text()) or {}
        except yaml.YAMLError:
            cfg = {}
    return records, cfg if isinstance(cfg, dict) else {}


def layout_label(run_dir: Path, cfg: dict[str, Any]) -> str:
    """``runs/tiny: pp2 vpp2 dp1 cp1 ep1 zero1 muon`` from the resolved config (the directory alone without one)."""
    p, o, m = cfg.get("parallel") or {}, cfg.get("optim") or {}, cfg.get("model") or {}
    parts = [f"{k}{p[k]}" for k in ("pp", "vpp", "dp", "cp", "ep", "zero") if k in p]
    if o.get("name"):
        parts.append(str(o["name"]))
    for key in sorted(k for k in m if "residual" in k):  # e.g. the residual kind (AttnRes vs standard)
        parts.append(f"{key}={m[key]}")
    return f"{run_dir}: {' '.join(parts)}" if parts else str(run_dir)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v) * SCALE.get(key, 1.0))
    return xs, ys


def plot_runs(run_dirs: list[Path], out: Path, title: str = "") -> Path:
    """Draw every run of ``run_dirs`` into one PNG at ``out``; returns ``out``."""
    runs = [(d, *read_run(d)) for d in run_dirs]
    import matplotlib  # noqa: PLC0415 - lazy: matplotlib is slow to import and only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - lazy: matplotlib, as above
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 - lazy: matplotlib, as above

    fig, axes = plt.subplots(2, 4, figsize=(18, 8), constrained_layout=True)
    flat = list(axes.flat)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, name) in zip(flat, PANELS):
        drawn = False
        for i, (d, records, cfg) in enumerate(runs):
            xs, ys = _series(records, key)
            color = colors[i % len(colors)]
            if xs:
                ax.plot(xs, ys, color=color, lw=1.2, label=layout_label(d, cfg))
                drawn = True
            if key == "loss":
                vx, vy = _series(records, "val_loss")
                if vx:
                    ax.plot(vx, vy, "o", color=color, ms=5, mfc="none")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not drawn:
            ax.text(0.5, 0.5, f"no run logged {key}", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
    legend_ax = flat[len(PANELS)]
    legend_ax.axis("off")
    handles, labels = flat[0].get_legend_handles_labels()
    legend_ax.legend(handles, labels, loc="center", fontsize=9, title="run: layout")
    fig.suptitle(title or ", ".join(str(d) for d in run_dirs))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="k3train plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (train.out_dir) to overlay")
    ap.add_argument("-o", "--output", required=True, metavar="FILE.png", help="the PNG to write")
    ap.add_argument("--title", default="", help="figure title (default: the run directories)")
    a = ap.parse_args(argv)
    try:
        out = plot_runs([Path(r) for r in a.runs], Path(a.output), a.title)
    except PlotError as e:
        return report_bad_input(e)
    print(f"k3train: wrote {out} ({len(a.runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
