"""The run summary rank 0 prints when training ends: what a user otherwise digs out of ``metrics.jsonl``.

Steps and tokens of this invocation, wall time, first/last/best loss and validation loss (an EAGLE-3 draft run: its
last acceptance on the training batch and on the validation split, k3train/draft/objective.py), mean tokens/s
(tokens over the summed step times) and MFU (with its denominator and where that came from), peak memory of
every rank (CPU: the process's peak resident set, ``ru_maxrss``; GPU: ``max_memory_allocated``), and the last
checkpoint written.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


DRAFT_KEYS = ("draft_accept", "draft_accept_len", "val_draft_accept", "val_draft_accept_len")


class RunSummary:
    """Collects the per-step records of one invocation (cheap: a few floats per step) on every rank."""

    def __init__(self, tokens_per_step: int, peak_flops: float, peak_source: str) -> None:
        self.tokens_per_step = tokens_per_step
        self.peak_flops, self.peak_source = peak_flops, peak_source
        self.records: list[dict[str, Any]] = []

    def add(self, rec: dict[str, Any]) -> None:
        self.records.append({k: rec[k] for k in ("step", "loss", "val_loss", "tokens_per_s", "step_time_s", "mfu",
                                                 "skipped", *DRAFT_KEYS) if k in rec})

    @staticmethod
    def _finite(values: list[Any]) -> list[float]:
        return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]

    def lines(self, wall_s: float, peak_mem_gib: list[float], last_checkpoint: str) -> list[str]:
        """The summary block (no communication)."""
        r = self.records
        if not r:
            return ["run summary: no step was run"]
        out = [f"run summary: steps {r[0]['step']}..{r[-1]['step']} ({len(r)} steps, "
               f"{sum(1 for x in r if x.get('skipped'))} skipped), {len(r) * self.tokens_per_step:,} tokens, "
               f"wall time {wall_s:.1f} s"]
        for key, name in (("loss", "loss"), ("val_loss", "val loss")):
            seq = [(x["step"], float(x[key])) for x in r
                   if isinstance(x.get(key), (int, float)) and math.isfinite(x[key])]
            if seq:
                best = min(seq, key=lambda t: t[1])
                out.append(f"  {name}: first {seq[0][1]:.4f} (step {seq[0][0]}), last {seq[-1][1]:.4f} (step "
                           f"{seq[-1][0]}), best {best[1]:.4f} (step {best[0]})")
        for prefix, name in (("", "training batch"), ("val_", "validation")):  # an EAGLE-3 draft run
            last = [x for x in r if isinstance(x.get(f"{prefix}draft_accept_len"), (int, float))]
            if last:
                x = last[-1]
                out.append(f"  draft acceptance ({name}, step {x['step']}): expected accepted length "
                           f"{x[f'{prefix}draft_accept_len']:.3f} of {len(x[f'{prefix}draft_accept'])}; per step "
                           + " ".join(f"{a:.3f}" for a in x[f"{prefix}draft_accept"]))
        step_s = sum(self._finite([x.get("step_time_s") for x in r]))
        mfu = self._finite([x.get("mfu") for x in r])
        if step_s > 0:
            out.append(f"  throughput: {len(r) * self.tokens_per_step / step_s:,.0f} tokens/s (mean over steps), "
                       f"mean step {step_s / len(r) * 1000:.0f} ms; MFU {100 * sum(mfu) / max(1, len(mfu)):.2f}% "
                       f"of {self.peak_flops / 1e9:.1f} GFLOP/s per rank ({self.peak_source})")
        out.append("  peak memory per rank (GiB): " + " ".join(f"r{i}={m:.2f}" for i, m in enumerate(peak_mem_gib)))
        out.append(f"  last checkpoint: {last_checkpoint}")
        return out


def gather_peak_memory(mem_gib: float, device: torch.device) -> list[float]:
    """Every rank's peak memory, on every rank (collective over the default group when it exists)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mem_gib]
    dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([mem_gib], dtype=torch.float64, device=dev)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [float(t.item()) for t in every]
