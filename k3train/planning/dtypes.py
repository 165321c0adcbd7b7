"""The parameters' and activations' dtype of a run (``train.dtype``): bf16, else fp32."""
from __future__ import annotations

from typing import Any

import torch


def train_dtype(cfg: Any) -> torch.dtype:
    return torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32


def dtype_bytes(cfg: Any) -> int:
    """Bytes per element of :func:`train_dtype`."""
    return 2 if cfg.train.dtype == "bfloat16" else 4
