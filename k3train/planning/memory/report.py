"""The estimate as a table: per pipeline stage, its ranks' bytes by category."""
from __future__ import annotations

from k3train.planning.memory.results import CATEGORIES, Estimate, RankMemory


def format_table(est: Estimate, all_ranks: bool = False) -> str:
    """Per pipeline stage: every rank (the worst one when a stage has more than 8, or all with ``all_ranks``),
    per category in GiB (MiB when every peak is under 4 GiB)."""
    big = max((r.peak for r in est.ranks), default=0) >= 4 * 2**30
    unit, div = ("GiB", 2**30) if big else ("MiB", 2**20)
    head = f"{'rank':>6} {'pp':>3} {'dp':>5} {'cp':>3} {'ep':>4} " + " ".join(f"{c:>11}" for c in CATEGORIES)
    head += f" {'peak ' + unit:>9} {'measured':>9} {'err':>6}  at"
    lines = [est.layout, head]
    by_pp: dict[int, list[RankMemory]] = {}
    for r in est.ranks:
        by_pp.setdefault(r.pp_rank, []).append(r)
    for pp, rs in sorted(by_pp.items()):
        show = rs if all_ranks or len(rs) <= 8 else [max(rs, key=lambda r: r.peak)]
        for r in show:
            meas = f"{r.measured_peak / div:9.3f}" if r.measured_peak else f"{'':>9}"
            err = f"{100 * (r.peak - r.measured_peak) / r.measured_peak:+5.1f}%" if r.measured_peak else ""
            lines.append(f"{r.rank:>6} {r.pp_rank:>3} {r.dp_rank:>5} {r.cp_rank:>3} {r.ep_rank:>4} "
                         + " ".join(f"{getattr(r, c) / div:11.3f}" for c in CATEGORIES)
                         + f" {r.peak / div:9.3f} {meas} {err:>6}  {r.peak_at}")
    return "\n".join(lines)
