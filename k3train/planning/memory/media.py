"""The media a vision model's first stage is traced on (:class:`MediaCase`), and the pixels a step holds."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.model.media import MediaInputs


@dataclass(frozen=True)
class MediaCase:
    """The media the first stage's traced step encodes (models with ``vision.enabled`` only).

    * ``source="worst"`` (default): synthetic media of the worst case for the micro-batch (:func:`worst_case_grids`):
      EVERY position of every row is a media placeholder, filled by the largest square images
      ``data.max_media_pixels`` allows that fit a row (a row shorter than one such image: the largest that fits),
      the rest of the row by one strip image one merged token high; ``frames`` per media (1: images; up to
      ``vision.pos_emb_time``: clips, ``frames`` x the patches per LM token). The encoder's work and memory
      are linear in the patches (the attention kernels are flash-style), so this is the most a row can cost;
    * ``source="data"``: the run's own micro-batches' media when the dataset can be read (real multimodal
      micro-batches only; synthetic rows get the worst case) -- what ``--measure`` runs;
    * ``source="none"``: no media (the encoder runs on zero patches: a vision model on text data).
    * ``source="auto"`` (default): ``worst`` when the run's data can hold media (``data.format: multimodal``),
      else ``none`` (``configs/k3.yaml`` trains its vision model on a text corpus: no media can occur).
    """
    source: str = "auto"
    frames: int = 1

    def resolved(self, cfg: Config) -> "MediaCase":
        """``auto`` decided for ``cfg`` (module docstring); any other source unchanged."""
        if self.source != "auto":
            return self
        return MediaCase("worst" if cfg.data.format == "multimodal" else "none", self.frames)

    def check(self, cfg: Config) -> None:
        if self.source not in ("auto", "worst", "data", "none"):
            raise ValueError(f"media case: source must be 'auto', 'worst', 'data' or 'none', got {self.source!r}")
        if cfg.vision.enabled and not 1 <= self.frames <= cfg.vision.pos_emb_time:
            raise ValueError(f"media case: frames must be in [1, vision.pos_emb_time={cfg.vision.pos_emb_time}] "
                             f"(the most frames a clip may have), got {self.frames}")

    def note(self, cfg: Config) -> str:
        """How the estimate's first stage traced the encoder (for the layout line)."""
        if not cfg.vision.enabled:
            return ""
        if self.source == "none":
            return "; vision encoder on no media"
        side = worst_case_side(cfg, cfg.train.seq_len) * cfg.vision.patch_size * cfg.vision.merge_size
        what = "images" if self.frames == 1 else f"{self.frames}-frame clips"
        worst = (f"every position of each {cfg.train.seq_len}-token row a placeholder of {side}x{side} px {what} "
                 f"(worst case, data.max_media_pixels={cfg.data.max_media_pixels}; any remainder one strip image)")
        return "; vision encoder on " + (worst if self.source == "worst" else
                                          f"the data's own media (synthetic rows: {worst})")


def worst_case_side(cfg: Config, row_len: int) -> int:
    """Side, in merged tokens, of the largest square media of the worst case: ``s x s`` tokens
    (``s * patch_size * merge`` px) with ``(s * patch_size * merge)^2 <= data.max_media_pixels`` and
    ``s^2 <= row_len``."""
    unit = cfg.vision.patch_size * cfg.vision.merge_size
    return max(1, min(math.isqrt(cfg.data.max_media_pixels) // unit, math.isqrt(row_len)))


def worst_case_grids(cfg: Config, row_len: int, frames: int = 1) -> list[tuple[int, int, int]]:
    """Patch grids ``(t, h, w)`` of one row of :class:`MediaCase`'s worst case: ``row_len // s^2`` square media
    of ``s x s`` merged tokens (:func:`worst_case_side`) and, for the ``r`` positions left, one strip of ``1 x r``
    merged tokens (``r * unit^2 < s^2 * unit^2`` px: within the pixel limit). Exactly ``row_len`` tokens."""
    m = cfg.vision.merge_size
    s = worst_case_side(cfg, row_len)
    k, r = divmod(row_len, s * s)
    return [(frames, s * m, s * m)] * k + ([(frames, m, r * m)] if r else [])


def media_batch(cfg: Config, batch: Any, case: MediaCase, cp_rank: int | None, fake: FakeTensorMode) -> Any:
    """``batch`` with the media :class:`MediaCase` asks for: the pixels fake (made in ``fake``), the tokens,
    grids and offsets real (the model plans the encoder's loop on them, as on real data). Under CP (``cp_rank``
    set) ``batch`` is one CP segment of rows ``cp * T`` long: the media cover the FULL rows and
    ``media_offsets`` place this segment's placeholders (as ``Batch.slice_cp``; every CP rank encodes them all,
    ``vision_cp`` unset: an upper bound where the encoder's patch split would apply)."""
    ph = cfg.model.media_placeholder_token_id
    real_mm = batch.media_token_id is not None  # a multimodal micro-batch from the run's loader
    if case.source == "data" and real_mm:
        return batch
    if case.source == "none":
        tokens = batch.tokens.masked_fill(batch.tokens == ph, 3) if real_mm else batch.tokens
        return dataclasses.replace(batch, tokens=tokens, media=None, media_rows=None, media_token_id=None,
                                   media_offsets=None)
    B, T = batch.tokens.shape
    C = cfg.parallel.cp if cp_rank is not None else 1
    grids = worst_case_grids(cfg, T * C, case.frames)
    p = cfg.vision.patch_size
    n = B * sum(t * h * w for t, h, w in grids)
    with fake:
        pixels = torch.empty(n, 3, p, p)
    media = MediaInputs(pixels, torch.tensor(grids * B, dtype=torch.long).reshape(-1, 3))
    offsets = torch.arange(B, dtype=torch.long) * (T * C) + (cp_rank or 0) * T if C > 1 else None
    return dataclasses.replace(batch, tokens=torch.full_like(batch.tokens, ph), media=media,
                               media_rows=torch.arange(B).repeat_interleave(len(grids)), media_token_id=ph,
                               media_offsets=offsets, vision_cp=None)


def media_pixel_bytes(cfg: Config, step: list[Any] | None, case: MediaCase) -> int:
    """Bytes of one step's media pixels on a rank (the loader hands over all ``grad_accum_steps`` micro-batches
    of a step at once, each with the media of its full rows, float32): the real ones of ``step`` with
    ``source="data"`` and real data, else the worst case's (``micro_batch_size`` rows of ``seq_len``)."""
    if not cfg.vision.enabled or case.source == "none":
        return 0
    if case.source == "data" and step and all(mb.media_token_id is not None for mb in step):
        return sum(mb.media.pixel_values.nbytes for mb in step if mb.media is not None)
    p = cfg.vision.patch_size
    patches = sum(t * h * w for t, h, w in worst_case_grids(cfg, cfg.train.seq_len, case.frames))
    return cfg.train.grad_accum_steps * cfg.train.micro_batch_size * patches * 3 * p * p * 4
