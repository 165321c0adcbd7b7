"""Plain helpers of the data tests (importable by name; conftest modules are not)."""
from __future__ import annotations

import shutil
from pathlib import Path

from k3train.config import Config


def copy_dataset(prefix: Path, dst_dir: Path) -> Path:
    """Copy PREFIX.{bin,idx,meta.json} into ``dst_dir`` (a fresh place, so no index cache exists yet)."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copy(str(prefix) + ext, dst_dir / (prefix.name + ext))
    return dst_dir / prefix.name


def make_cfg(prefix: Path, gbs: int = 8, mbs: int = 2, seq_len: int = 32, steps: int = 20, seed: int = 1234,
             split: str = "90,10,0") -> Config:
    cfg = Config()
    cfg.model.vocab_size = 4096
    cfg.data.path = str(prefix)
    cfg.data.split = split
    cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = seq_len, gbs, mbs
    cfg.train.steps, cfg.train.seed = steps, seed
    return cfg
