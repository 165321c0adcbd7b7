"""The prepared media store: resized pixels of every image / clip, read by index at training time.

Files (next to the token dataset ``PREFIX.bin/.idx``):

* ``PREFIX.media.bin``: uint8 RGB pixels of all media back to back, each media ``[t, h, w, 3]`` (frames,
  rows, columns, channels), already resized to multiples of ``patch_size * merge`` (28 px);
* ``PREFIX.media.npy``: int64 ``[n_media, 6]`` index, one row per media in (document, position) order:
  ``OFFSET`` (byte offset in ``.media.bin``), ``FRAMES``, ``HEIGHT``, ``WIDTH`` (px), ``DOC`` (the document =
  sequence of the token dataset holding its placeholders) and ``TOKEN`` (offset in that document of its first
  placeholder token; the run is ``merged_tokens(grid)`` long).

Raw uint8 instead of PNG: reading a media at training time is one ``memmap`` slice, no decoder on the step's
critical path, and the offsets make any media addressable (the shards stay the compressed archive).

Pixel values handed to the model: ``x / 255`` normalised with mean 0.5 and std 0.5 per channel (range
[-1, 1]): the ``image_mean`` / ``image_std`` of K2.5's published ``preprocessor_config.json`` (``media_proc_cfg``,
read by its ``KimiK25VisionProcessor``; transformers is not installed here to import it), cut into
``[N, 3, p, p]`` patches in ``(t, h, w)`` raster order, channels first, as its ``navit_patchify`` does
(:mod:`k3train.model.media`).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import torch

from k3train.data.corpus import DataError
from k3train.model.media import MediaInputs

PIXEL_MEAN = 0.5
PIXEL_STD = 0.5
OFFSET, FRAMES, HEIGHT, WIDTH, DOC, TOKEN = range(6)
INDEX_COLUMNS = 6


def media_bin_path(prefix: str | Path) -> Path:
    return Path(str(prefix) + ".media.bin")


def media_index_path(prefix: str | Path) -> Path:
    return Path(str(prefix) + ".media.npy")


class MediaStoreWriter:
    """Append media (uint8 ``[t, h, w, 3]``) under temporary names; :meth:`commit` renames them into place."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.prefix.with_name(self.prefix.name + f".tmp{os.getpid()}")
        self._bin = open(media_bin_path(self._tmp), "wb")
        self._rows: list[list[int]] = []
        self._offset = 0

    def add(self, frames: np.ndarray, doc: int, token: int) -> None:
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
            raise ValueError(f"media must be uint8 [t, h, w, 3], got {frames.dtype} {frames.shape}")
        t, h, w, _ = frames.shape
        self._bin.write(np.ascontiguousarray(frames).tobytes())
        self._rows.append([self._offset, t, h, w, doc, token])
        self._offset += frames.size

    @property
    def num_media(self) -> int:
        return len(self._rows)

    def commit(self) -> None:
        self._bin.close()
        np.save(media_index_path(self._tmp), np.asarray(self._rows, dtype=np.int64).reshape(-1, INDEX_COLUMNS))
        for fn in (media_bin_path, media_index_path):
            os.replace(fn(self._tmp), fn(self.prefix))

    def abort(self) -> None:
        self._bin.close()
        for fn in (media_bin_path, media_index_path):
            with contextlib.suppress(FileNotFoundError):
                fn(self._tmp).unlink()


def load_media_index(prefix: str | Path) -> np.ndarray:
    """The ``[n_media, 6]`` index, its byte offsets checked against ``.media.bin`` (one :class:`DataError`)."""
    ip, bp = media_index_path(prefix), media_bin_path(prefix)
    for p in (ip, bp):
        if not p.is_file():
            raise DataError(f"media store file not found: {p} (build it with tools/prepare_data.py --multimodal)")
    try:
        index = np.load(ip, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{ip}: unreadable media index ({str(e).splitlines()[0]})") from None
    if index.ndim != 2 or index.shape[1] != INDEX_COLUMNS or index.dtype != np.int64:
        raise DataError(f"{ip}: media index must be int64 [n, {INDEX_COLUMNS}], got {index.dtype} {index.shape}")
    sizes = index[:, FRAMES] * index[:, HEIGHT] * index[:, WIDTH] * 3
    if (index[:, FRAMES:WIDTH + 1] < 1).any():
        bad = int(np.argmax((index[:, FRAMES:WIDTH + 1] < 1).any(axis=1)))
        raise DataError(f"{ip}: media {bad} has an empty shape {tuple(index[bad, FRAMES:WIDTH + 1])}")
    expected = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(index) else sizes
    if not np.array_equal(index[:, OFFSET], expected):
        bad = int(np.argmax(index[:, OFFSET] != expected))
        raise DataError(f"{ip}: byte offset of media {bad} is {int(index[bad, OFFSET])}, expected "
                        f"{int(expected[bad])}: corrupt index")
    total = int(sizes.sum())
    if bp.stat().st_size != total:
        raise DataError(f"{bp}: {bp.stat().st_size} bytes but {ip.name} describes {total}: truncated, or the index "
                        "belongs to another store")
    return index


class MediaStore:
    """Random access to the prepared media; :meth:`inputs` builds a micro-batch's :class:`MediaInputs`."""

    def __init__(self, prefix: str | Path, patch_size: int = 14) -> None:
        self.index = load_media_index(prefix)
        self.patch_size = patch_size
        n = int(media_bin_path(prefix).stat().st_size)
        self._data = np.memmap(media_bin_path(prefix), dtype=np.uint8, mode="r") if n else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def pixels(self, i: int) -> np.ndarray:
        """uint8 ``[t, h, w, 3]`` of media ``i``."""
        off, t, h, w = (int(v) for v in self.index[i, :4])
        return np.array(self._data[off:off + t * h * w * 3]).reshape(t, h, w, 3)  # a copy: writable for torch

    def grid(self, i: int) -> tuple[int, int, int]:
        t, h, w = (int(v) for v in self.index[i, FRAMES:WIDTH + 1])
        return t, h // self.patch_size, w // self.patch_size

    def inputs(self, ids: list[int]) -> MediaInputs:
        """The media ``ids`` (in placeholder order) as patches; no media gives :meth:`MediaInputs.empty`."""
        if not ids:
            return MediaInputs.empty(self.patch_size)
        return MediaInputs(torch.cat([to_patches(self.pixels(i), self.patch_size) for i in ids]),
                           torch.tensor([self.grid(i) for i in ids], dtype=torch.long))


def to_patches(frames: np.ndarray, patch_size: int = 14) -> torch.Tensor:
    """uint8 ``[t, h, w, 3]`` -> normalised float32 ``[t * h/p * w/p, 3, p, p]`` in ``(t, h, w)`` raster order."""
    t, h, w, _ = frames.shape
    p = patch_size
    x = (torch.from_numpy(np.ascontiguousarray(frames)).float() / 255.0 - PIXEL_MEAN) / PIXEL_STD
    x = x.reshape(t, h // p, p, w // p, p, 3).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(t * (h // p) * (w // p), 3, p, p).contiguous()

