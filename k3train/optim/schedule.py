"""Learning-rate schedules as one pure function of the step.

All schedules share a linear warm-up: ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (so step 0
already trains). After it, with ``peak = optim.lr`` and ``floor = optim.min_lr_ratio * peak``:

* ``cosine`` (K3's choice -- its scaling-law study preferred it over WSD): half a cosine from ``peak`` at the end
  of warm-up to ``floor`` at ``total_steps``; ``floor`` afterwards.
* ``wsd`` (warmup-stable-decay): ``peak`` until the last ``wsd_decay_fraction * total_steps`` steps, then linear
  to ``floor`` at ``total_steps``.
* ``constant``: ``peak`` after warm-up.

``step`` is 0-based: the lr used by the optimizer step that follows the ``step``-th forward/backward.
"""
from __future__ import annotations

import math
from typing import Any


def lr_at(step: int, cfg: Any, total_steps: int) -> float:
    """Learning rate for 0-based ``step`` of a run of ``total_steps`` under ``cfg`` (an ``OptimConfig``)."""
    if step < 0:
        raise ValueError(f"lr_at: step must be >= 0, got {step}")
    if total_steps < 1:
        raise ValueError(f"lr_at: total_steps must be >= 1, got {total_steps}")
    peak = float(cfg.lr)
    floor = peak * float(cfg.min_lr_ratio)
    warm = int(cfg.warmup_steps)
    if step < warm:
        return peak * (step + 1) / warm
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = total_steps - warm
        if span <= 0:
            return floor
        progress = min(1.0, (step - warm) / span)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":
        frac = float(cfg.wsd_decay_fraction)
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"optim.wsd_decay_fraction must be in [0, 1], got {frac}")
        decay_steps = int(round(frac * total_steps))
        start = max(warm, total_steps - decay_steps)
        if step < start:
            return peak
        span = total_steps - start
        if span <= 0:
            return floor
        progress = min(1.0, (step - start) / span)
        return peak + (floor - peak) * progress
    raise ValueError(f"optim.schedule: expected 'cosine', 'wsd' or 'constant', got {cfg.schedule!r}")
