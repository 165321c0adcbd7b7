"""The plan as a table and as a plot (predicted throughput against peak memory)."""
from __future__ import annotations

from k3train.planning.search.rows import PlanResult, Row, mfu


def gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def peak_text(r: Row) -> str:
    """A row's peak in GiB: its estimate, ``>`` a lower bound (a trace stopped over the device), ``<=`` an upper
    bound (ranked untraced)."""
    if r.peak_bytes is None and r.mem_upper is not None:
        return "<=" + gib(r.mem_upper)
    return (">" if r.peak_is_bound else "") + gib(r.peak_bytes)


def format_table(res: PlanResult, rows: list[Row]) -> str:
    cfg, W = res.base_cfg, res.world
    head = (f"{'#':>3} {'layout':<40} {'step s':>9} {'tok/s/dev':>10} {'MFU':>6} {'bubble':>6} {'comm':>6} "
            f"{'opt':>5} {'peak GiB':>9}  {'per stage GiB':<24} {'measured':>9}")
    lines = [head]
    for i, r in enumerate(rows, 1):
        p = r.pred
        tps = (r.tokens_per_s(cfg) or 0) / W
        stages = ",".join(f"{s / 2**30:.1f}" for s in r.stage_peaks[:8]) + ("..." if len(r.stage_peaks) > 8 else "")
        meas = f"{r.measured_step_s:9.3f}" if r.measured_step_s is not None else f"{'':>9}"
        lines.append(f"{i:>3} {r.layout.short():<40} {p.step_s:9.4g} {tps:10.4g} {100 * mfu(r, cfg, W, res.device.peak_flops):5.1f}% "
                     f"{100 * p.bubble / p.step_s:5.1f}% {100 * p.exposed_comm / p.step_s:5.1f}% "
                     f"{100 * p.optimizer / p.step_s:4.1f}% {peak_text(r):>9}"
                     f"  {stages:<24} {meas}")
    return "\n".join(lines)


def plot(res: PlanResult, path: str, chosen: Row | None, mark: Row | None = None) -> None:
    import matplotlib  # lazy: matplotlib is optional (only --plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional (only --plot needs it)

    cfg, W = res.base_cfg, res.world
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for fits, color, label in ((True, "tab:blue", "fits"), (False, "tab:red", "does not fit")):
        pts = [(r.peak_bytes / 2**30, (r.tokens_per_s(cfg) or 0) / W) for r in res.rows
               if r.pred is not None and r.peak_bytes is not None and bool(r.fits) == fits]
        if pts:
            ax.scatter(*zip(*pts), s=12, color=color, alpha=0.6, label=label)
    ax.axvline(res.device.hbm_bytes / 2**30, color="gray", ls="--", lw=1, label="device memory")
    for r, mk, lab in ((chosen, "*", "chosen"), (mark, "D", "reference")):
        if r is not None and r.pred is not None and r.peak_bytes is not None:
            ax.scatter([r.peak_bytes / 2**30], [(r.tokens_per_s(cfg) or 0) / W], s=160, marker=mk, color="k",
                       label=f"{lab}: {r.layout.short()}", zorder=3)
    ax.set_xlabel("peak memory of the worst rank (GiB)")
    ax.set_ylabel("predicted tokens/s per device")
    ax.set_title(f"{cfg.source or ''}: {W} x {res.device.name}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
