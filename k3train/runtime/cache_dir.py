"""Where k3train caches what it measures on a machine (the MFU denominator, the planner's cpu calibration):
``$K3TRAIN_CACHE_DIR`` if set (e.g. the test suite's own), else ``$XDG_CACHE_HOME/k3train``, else
``~/.cache/k3train``."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("K3TRAIN_CACHE_DIR"):
        return Path(os.environ["K3TRAIN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3train"
