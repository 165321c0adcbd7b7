"""What the memory estimate and the planner model: checked before any work (no torch loaded)."""
from __future__ import annotations

from typing import Any

from k3train.config import ConfigError


def check_modelled(cfg: Any) -> None:
    """Refuse (one ConfigError line) what this estimate does not model: ``train.objective=eagle3`` runs the frozen
    target forward-only with the draft's forward and backward on the last stage (k3train/draft/objective.py), not
    the LM training step traced here. Called by tools/memory.py and tools/plan.py before any work."""
    if cfg.train.objective != "lm":
        raise ConfigError(f"train.objective: the memory estimate and the planner model LM training (train.objective="
                          f"lm), not the {cfg.train.objective} draft step ({cfg.origin('train.objective')})")
