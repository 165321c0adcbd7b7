"""The kernel names of ``train.<op>_kernel``: the ops, each op's backends, and the check of a setting's name --
without torch and without probing the machine. Which backend runs where (and whether a forced one can run here)
is k3train/model/kernels.py's choice, made at start-up."""
from __future__ import annotations

from typing import Any

OPS = ("kda", "mla", "experts")
BACKENDS: dict[str, tuple[str, ...]] = {
    "kda": ("auto", "torch", "fla"),
    "mla": ("auto", "dense", "blockwise", "flex"),
    "experts": ("auto", "grouped_mm", "padded_bmm", "loop"),
}


def kernel_settings(train_cfg: Any) -> dict[str, str]:
    """``{op: setting}`` from ``train.kda_kernel`` / ``train.mla_kernel`` / ``train.experts_kernel``."""
    return {op: str(getattr(train_cfg, f"{op}_kernel", "auto")) for op in OPS}


def check_kernel_names(train_cfg: Any) -> tuple[str, str] | None:
    """For the config validator (no torch, no probing): ``(key, message)`` of the first ``train.<op>_kernel``
    that is not one of its op's backends, else None."""
    for op, want in kernel_settings(train_cfg).items():
        if want not in BACKENDS[op]:
            return f"train.{op}_kernel", f"must be one of {', '.join(BACKENDS[op])}, got {want!r}"
    return None
