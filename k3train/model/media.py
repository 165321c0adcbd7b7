"""The media part of a micro-batch and the one rule for how many LM tokens a picture or clip becomes.

Shared by the data pipeline (which expands every media placeholder to :func:`merged_tokens` copies of the
placeholder id) and by the vision encoder (whose ``sd2_tpool`` merge produces exactly that many embeddings), so
the two can never disagree.

Layout conventions (those of the K2.5-format vision tower in Hugging Face transformers' ``kimi_k25``):

* ``grid_thw [n_media, 3]`` (int64): per image / video clip, frames ``t`` and patch rows ``h`` / columns ``w``
  (pixels / patch size). An image has ``t = 1``.
* ``pixel_values [N, 3, p, p]`` (float): the patches of all media of the micro-batch, media in order, each
  media's ``t * h * w`` patches in ``(t, h, w)`` raster order, ``N = sum(t * h * w)``.
* ``sd2_tpool`` merge: 2 x 2 neighbouring patches concatenated, mean over the ``t`` frames -> a media gives
  ``(h / 2) * (w / 2)`` LM tokens whatever ``t`` is (``h`` and ``w`` must be even).
  448 x 448 px -> 32 x 32 patches -> 256 tokens; 1792 -> 4096; 3584 -> 16384 (seed 000's table).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def patch_grid(height_px: int, width_px: int, frames: int = 1, patch_size: int = 14,
               merge: int = 2) -> tuple[int, int, int]:
    """``(t, h, w)`` in patches of a ``frames x height_px x width_px`` picture/clip. The sizes must already be
    multiples of ``patch_size * merge`` (the data pipeline resizes to that); anything else is a ``ValueError``."""
    unit = patch_size * merge
    if frames < 1 or height_px < unit or width_px < unit or height_px % unit or width_px % unit:
        raise ValueError(f"media of {frames} x {height_px} x {width_px} px: height and width must be positive "
                         f"multiples of patch_size * merge = {unit} and frames >= 1")
    return frames, height_px // patch_size, width_px // patch_size


def merged_tokens(t: int, h: int, w: int, merge: int = 2) -> int:
    """LM tokens of one media with a ``(t, h, w)`` patch grid after the ``merge x merge`` spatial merge and the
    temporal mean: ``(h / merge) * (w / merge)``."""
    if t < 1 or h % merge or w % merge or h < merge or w < merge:
        raise ValueError(f"patch grid ({t}, {h}, {w}) does not merge by {merge} x {merge}")
    return (h // merge) * (w // merge)


@dataclass
class MediaInputs:
    """Images and clips of one micro-batch (all rows together, in placeholder order: row-major over
    ``[B, T]``). ``pixel_values [N, 3, p, p]`` float, ``grid_thw [n_media, 3]`` int64 (see the module doc)."""

    pixel_values: Tensor
    grid_thw: Tensor

    @property
    def num_media(self) -> int:
        return int(self.grid_thw.shape[0])

    def num_patches(self) -> int:
        return int((self.grid_thw[:, 0] * self.grid_thw[:, 1] * self.grid_thw[:, 2]).sum()) if self.num_media else 0

    def num_tokens(self, merge: int = 2) -> int:
        """LM placeholder positions these media fill."""
        return sum(merged_tokens(int(t), int(h), int(w), merge) for t, h, w in self.grid_thw.tolist())

    def to(self, device: torch.device | str) -> "MediaInputs":
        return MediaInputs(self.pixel_values.to(device), self.grid_thw.to(device))

    @classmethod
    def empty(cls, patch_size: int = 14, dtype: torch.dtype = torch.float32) -> "MediaInputs":
        """No media (a text-only micro-batch of a multimodal run: the encoder still runs on zero patches so every
        rank executes the same program)."""
        return cls(torch.zeros(0, 3, patch_size, patch_size, dtype=dtype), torch.zeros(0, 3, dtype=torch.long))
