"""Energon shards -> what training reads quickly: a Megatron indexed dataset of token ids + the media store.

Each shard sample becomes one document (one sequence of ``PREFIX.bin/.idx``, EOS appended): its text elements
tokenized, each image / clip replaced by ``[<|media_start|>] + merged_tokens(grid) x <|media_pad|> +
[<|media_end|>]`` (the delimiters only when the tokenizer has them), its pixels resized to multiples of
``patch_size * merge`` (bicubic, to the nearest multiple, at least one unit) and appended to the media store
(:mod:`k3train.data.multimodal.media_store`). ``PREFIX.meta.json`` gets a ``multimodal`` entry: the patch
geometry, the placeholder / delimiter ids and the media count, which start-up checks against the run.

Bad input is one :class:`DataError` naming the shard member: an undecodable picture, a reference to a picture
the sample does not have, clip frames of different sizes, a picture larger than ``max_media_pixels`` (after the
resize), text that contains a special token's literal text.
"""
from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from k3train.data.corpus import DataError
from k3train.data.dataset import IndexInfo, write_indexed_dataset
from k3train.data.multimodal.media_store import MediaStoreWriter
from k3train.data.multimodal.shards import ShardSample, read_energon
from k3train.data.multimodal.vl_tokenizer import MEDIA_END, MEDIA_START
from k3train.data.tokenizer import TextTokenizer
from k3train.model.media import merged_tokens, patch_grid

MAX_MEDIA_PIXELS = 3584 * 3584  # seed 000: the largest input (16384 tokens)


def decode_picture(data: bytes, where: str) -> Image.Image:
    """An RGB PIL image from PNG (or any PIL-readable) bytes; a corrupt file is a :class:`DataError`."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, zlib.error... for broken files
        raise DataError(f"{where}: cannot decode image ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'corrupt'})") from None


def resized_size(height: int, width: int, unit: int = 28) -> tuple[int, int]:
    """``(h, w)`` rounded to the nearest multiples of ``unit`` (at least ``unit``)."""
    return max(unit, int(round(height / unit)) * unit), max(unit, int(round(width / unit)) * unit)


class _Converter:
    def __init__(self, tok: TextTokenizer, media: MediaStoreWriter, max_media_pixels: int, patch_size: int,
                 merge: int) -> None:
        if tok.media_id is None:
            raise DataError(f"tokenizer {tok.path} has no media placeholder token: name it (--media-token, e.g. "
                            "<|media_pad|> of k3train/data/assets/tokenizer-vl.json)")
        self.tok, self.media, self.max_pixels = tok, media, max_media_pixels
        self.patch, self.merge, self.unit = patch_size, merge, patch_size * merge
        vocab = tok._tok.get_vocab(with_added_tokens=True)
        self.start_id, self.end_id = vocab.get(MEDIA_START), vocab.get(MEDIA_END)
        self.special = set(tok.special_ids) | {i for i in (self.start_id, self.end_id) if i is not None}
        self.num_docs = 0

    def _frames(self, s: ShardSample, refs: list[Any], where: str) -> np.ndarray:
        frames = []
        for n in refs:
            if not isinstance(n, int) or isinstance(n, bool):
                raise DataError(f"{where}: picture reference {n!r} is not an integer")
            if n not in s.pictures:
                raise DataError(f"{where}: refers to picture {n} but the sample has no member {s.key}.{n}.png")
            member = f"{s.source}.{n}.png"
            im = decode_picture(s.pictures[n], member)
            h, w = resized_size(im.height, im.width, self.unit)
            if h * w > self.max_pixels:
                raise DataError(f"{member}: image of {im.width}x{im.height} px ({h * w} px after resizing to "
                                f"{w}x{h}) is larger than the limit of {self.max_pixels} px (--max-media-pixels / "
                                "data.max_media_pixels); downscale it or raise the limit")
            if (h, w) != (im.height, im.width):
                im = im.resize((w, h), Image.Resampling.BICUBIC)
            frames.append(np.asarray(im, dtype=np.uint8))
        if not frames:
            raise DataError(f"{where}: a video needs at least one frame")
        if len({f.shape for f in frames}) > 1:
            raise DataError(f"{where}: the frames of a clip must have one size, got "
                            f"{sorted({f.shape[:2] for f in frames})}")
        return np.stack(frames)

    def document(self, s: ShardSample) -> np.ndarray:
        ids: list[int] = []
        for k, el in enumerate(s.sequence):
            where = f"{s.source}.json: sequence[{k}]"
            if isinstance(el, str):
                enc = self.tok.encode(el)
                hit = [i for i in enc if i in self.special]
                if hit:
                    raise DataError(f"{where}: text contains the special token text {self.tok.decode(hit[:1])!r}")
                ids.extend(enc)
                continue
            if not (isinstance(el, dict) and len(el) == 1 and ("image" in el or "video" in el)):
                raise DataError(f"{where}: expected text, {{\"image\": n}} or {{\"video\": [n, ...]}}, got {el!r}")
            refs = [el["image"]] if "image" in el else el["video"]
            if not isinstance(refs, list):
                raise DataError(f"{where}: \"video\" must be a list of picture numbers")
            frames = self._frames(s, refs, where)
            try:
                grid = patch_grid(frames.shape[1], frames.shape[2], frames.shape[0], self.patch, self.merge)
            except ValueError as e:
                raise DataError(f"{where}: {e}") from None
            if self.start_id is not None:
                ids.append(self.start_id)
            self.media.add(frames, self.num_docs, len(ids))
            ids.extend([self.tok.media_id] * merged_tokens(*grid, self.merge))
            if self.end_id is not None:
                ids.append(self.end_id)
        self.num_docs += 1
        return np.asarray(ids, dtype=np.int64)


def prepare_multimodal(shard_dir: str | Path, tok: TextTokenizer, output_prefix: str | Path,
                       max_media_pixels: int = MAX_MEDIA_PIXELS, patch_size: int = 14, merge: int = 2
                       ) -> tuple[IndexInfo, int]:
    """Convert the Energon dataset ``shard_dir`` into ``output_prefix.{bin,idx,meta.json,media.bin,media.npy}``.
    Returns the token dataset's index and the number of media."""
    media = MediaStoreWriter(output_prefix)
    conv = _Converter(tok, media, max_media_pixels, patch_size, merge)

    def docs() -> Iterator[np.ndarray]:
        for s in read_energon(shard_dir):
            yield conv.document(s)

    meta = {"tokenizer": str(tok.path), "tokenizer_sha256": tok.sha256, "inputs": [str(shard_dir)],
            "multimodal": {"patch_size": patch_size, "merge": merge, "placeholder_id": tok.media_id,
                           "media_start_id": conv.start_id, "media_end_id": conv.end_id,
                           "max_media_pixels": max_media_pixels}}
    try:
        # the media store is complete once the last document is tokenized; commit it before the tokens are
        # renamed into place, so a reader that sees the token files always finds their media
        def docs_then_commit() -> Iterator[np.ndarray]:
            yield from docs()
            meta["multimodal"]["num_media"] = media.num_media
            media.commit()

        info = write_indexed_dataset(output_prefix, docs_then_commit(), tok.eos_id, tok.vocab_size, meta)
    except BaseException:
        media.abort()
        raise
    return info, media.num_media
