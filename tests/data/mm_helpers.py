"""Helpers of the multimodal data tests: small Energon datasets, prepared datasets and run configs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from k3train.config import Config
from k3train.data.multimodal.prepare import prepare_multimodal
from k3train.data.multimodal.shards import write_energon_meta, write_shard
from k3train.data.multimodal.shipped import build_shipped_shards, png_bytes
from k3train.data.multimodal.vl_tokenizer import MEDIA_PAD, VL_SPECIAL, VL_TOKENIZER
from k3train.data.tokenizer import load_tokenizer

PH = 4096  # <|media_pad|> in tokenizer-vl.json


def vl_tok():
    return load_tokenizer(VL_TOKENIZER, VL_SPECIAL)


def picture(w: int, h: int, seed: int = 0) -> bytes:
    """A PNG of ``w x h`` px with deterministic noise (every pixel matters for the pixel round trip)."""
    rng = np.random.default_rng(seed)
    return png_bytes(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))


def write_dataset(root: Path, samples: list[tuple[str, list[Any], list[bytes]]]) -> Path:
    """One-shard Energon dataset of ``samples``."""
    write_energon_meta(root, {"shards/shard_000.tar": write_shard(root / "shards/shard_000.tar", samples)})
    return root


def small_shipped(root: Path) -> Path:
    """A small version of the shipped corpus (80 samples), prepared; returns the prefix."""
    build_shipped_shards(root / "wds", n_ocr=40, n_code=30, n_video=10)
    prepare_multimodal(root / "wds", vl_tok(), root / "mm")
    return root / "mm"


def mm_cfg(prefix: Path, gbs: int = 8, mbs: int = 2, seq_len: int = 96, steps: int = 10, seed: int = 7,
           split: str = "100,0,0") -> Config:
    cfg = Config()
    cfg.model.vocab_size, cfg.model.media_placeholder_token_id = 4224, PH
    cfg.data.path, cfg.data.tokenizer, cfg.data.split = str(prefix), str(VL_TOKENIZER), split
    cfg.data.media_placeholder_token, cfg.data.format = MEDIA_PAD, "multimodal"
    cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = seq_len, gbs, mbs
    cfg.train.steps, cfg.train.seed = steps, seed
    return cfg


def check_args(prefix: Path, out: Path, *extra: str) -> list[str]:
    """``k3train check`` of configs/tiny.yaml (vision enabled: multimodal data needs it) on the multimodal dataset
    ``prefix``."""
    return ["check", "--config", "configs/tiny.yaml", "--world-size", "1", f"--train.out_dir={out}",
            "--model.vocab_size=4224", f"--model.media_placeholder_token_id={PH}", "--data.format=multimodal",
            f"--data.path={prefix}", f"--data.tokenizer={VL_TOKENIZER}", f"--data.media_placeholder_token={MEDIA_PAD}",
            "--data.split=100,0,0", "--vision.enabled=true", *extra]
