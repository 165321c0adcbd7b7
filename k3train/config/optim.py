"""The ``optim`` section: Muon (Per-Head Muon, QK-Clip) + AdamW, the LR schedule; and its check."""
from __future__ import annotations

from dataclasses import dataclass, field

from k3train.config.report import Need


@dataclass
class OptimConfig:
    name: str = "muon"  # "muon" (Muon for matrices + AdamW for the rest) | "adamw"
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"  # "cosine" | "wsd" | "constant"
    warmup_steps: int = 10
    wsd_decay_fraction: float = 0.2
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "float32"  # "float32" | "bfloat16"
    per_head_muon: bool = True
    qk_clip_threshold: float = 100.0  # 0 disables QK-Clip
    # parameter-name substrings forced to AdamW even when 2-D (embedding, LM head, ...)
    adamw_param_patterns: list[str] = field(default_factory=lambda: ["embed", "lm_head"])


def check_optim(o: OptimConfig, need: Need) -> None:
    need(o.name in ("muon", "adamw"), "optim.name", f"must be 'muon' or 'adamw', got {o.name!r}")
    need(o.schedule in ("cosine", "wsd", "constant"), "optim.schedule", "must be 'cosine', 'wsd' or 'constant'")
    need(o.lr > 0, "optim.lr", "must be > 0")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    need(o.ns_dtype in ("float32", "bfloat16"), "optim.ns_dtype", "must be 'float32' or 'bfloat16'")
    need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    for k in ("adam_beta1", "adam_beta2", "muon_momentum"):
        need(0 <= getattr(o, k) < 1, f"optim.{k}", f"must be in [0, 1), got {getattr(o, k)}")
    need(o.adam_eps > 0, "optim.adam_eps", f"must be > 0, got {o.adam_eps}")
    need(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    need(o.ns_steps >= 1, "optim.ns_steps", f"must be >= 1, got {o.ns_steps}")
    need(0 <= o.wsd_decay_fraction <= 1, "optim.wsd_decay_fraction", "must be in [0, 1]")
    need(o.qk_clip_threshold >= 0, "optim.qk_clip_threshold", "must be >= 0 (0 disables QK-Clip)")
