"""The ``logging`` section: log levels and interval, wandb, the peak FLOP/s for MFU; and its check."""
from __future__ import annotations

from dataclasses import dataclass

from k3train.config.report import Need

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class LoggingConfig:
    wandb: bool = True
    wandb_mode: str = "offline"
    wandb_project: str = "k3train"
    log_interval: int = 1
    peak_flops: float = 0.0  # FLOP/s per rank for MFU; 0 = measure a matmul at start-up
    level: str = "INFO"


def check_logging(lg: LoggingConfig, need: Need) -> None:
    need(lg.log_interval >= 1, "logging.log_interval", f"must be >= 1 (print every N steps), got {lg.log_interval}")
    need(lg.level in LOG_LEVELS, "logging.level", f"must be one of {', '.join(LOG_LEVELS)}, got {lg.level!r}")
    need(lg.wandb_mode in WANDB_MODES, "logging.wandb_mode",
         f"must be one of {', '.join(WANDB_MODES)}, got {lg.wandb_mode!r}")
    need(lg.peak_flops >= 0, "logging.peak_flops", "must be >= 0 (0 = measure at start-up)")
