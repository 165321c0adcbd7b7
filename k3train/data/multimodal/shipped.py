"""The shipped multimodal corpus: built offline and deterministically from the shipped text and small programs.

Three kinds of samples (``random.Random(seed)`` picks every size, colour and passage; Pillow's built-in bitmap
font draws the text, so nothing is read from the network or from system fonts):

* **ocr**: one or two passages of the shipped KJV text rendered black on white (an image 112..224 px wide), each
  followed by its exact transcription -- an OCR task.
* **code**: a picture drawn by a small generated Python/PIL program (rectangles, ellipses, lines, polygons, or a
  plotted curve) followed by the program's source, the K3 report's "visuals paired with the code that drew them".
  The program text IS what drew the picture: :func:`run_drawing` executes it.
* **video**: a clip of 2..4 frames of a shape moving across the picture, with a caption saying what moves where.

One more kind is not in the shipped corpus (``n_picture=0``; ``benchmarks/bench_vision_learns.py`` asks for it):

* **picture**: one still picture of a large shape, with a caption right after it naming its colour and shape
  (``A red circle.``), words that only the pixels determine.

All sizes are multiples of 28 px between 56 and 224 (CPU-sized; up to 64 LM tokens per media). The samples are
written as a Megatron-Energon WebDataset (:mod:`k3train.data.multimodal.shards`), 4 shards.
"""
from __future__ import annotations

import io
import itertools
import random
import textwrap
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from k3train.data.corpus import DEFAULT_CORPUS, read_documents
from k3train.data.multimodal.shards import write_energon_meta, write_shard

SIZES = (56, 84, 112, 140, 168, 196, 224)
COLORS = ("red", "green", "blue", "orange", "purple", "black", "teal", "brown")
FONT_W, LINE_H, MARGIN = 6, 12, 4  # Pillow's built-in bitmap font: 6 px per character, 11 px lines


def png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def render_text(text: str, width: int, max_height: int = 224) -> tuple[Image.Image, str]:
    """Render ``text`` wrapped to ``width`` px; returns the picture (height a multiple of 28, at most
    ``max_height``) and the text exactly as drawn (the lines that fit)."""
    font = ImageFont.load_default_imagefont()
    lines = textwrap.wrap(text, width=(width - 2 * MARGIN) // FONT_W) or [""]
    lines = lines[:(max_height - 2 * MARGIN) // LINE_H]
    height = min(max_height, max(56, -(-(len(lines) * LINE_H + 2 * MARGIN) // 28) * 28))
    im = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(im)
    for k, line in enumerate(lines):
        draw.text((MARGIN, MARGIN + k * LINE_H), line, fill="black", font=font)
    return im, "\n".join(lines)


def run_drawing(code: str) -> Image.Image:
    """Execute a generated drawing program; it leaves its picture in ``img``."""
    scope: dict[str, Any] = {}
    exec(compile(code, "<drawing>", "exec"), scope)  # noqa: S102 - our own generated programs
    return scope["img"]


def shape_program(rng: random.Random) -> str:
    w, h = rng.choice(SIZES), rng.choice(SIZES)
    lines = ["from PIL import Image, ImageDraw", "",
             f'img = Image.new("RGB", ({w}, {h}), "{rng.choice(["white", "lightyellow", "lightgray"])}")',
             "draw = ImageDraw.Draw(img)"]
    for _ in range(rng.randint(1, 4)):
        x0, y0 = rng.randrange(0, w - 20), rng.randrange(0, h - 20)
        x1, y1 = rng.randrange(x0 + 10, w), rng.randrange(y0 + 10, h)
        kind, col = rng.choice(("rectangle", "ellipse", "line", "polygon")), rng.choice(COLORS)
        if kind == "line":
            lines.append(f'draw.line(({x0}, {y0}, {x1}, {y1}), fill="{col}", width={rng.randint(1, 4)})')
        elif kind == "polygon":
            lines.append(f'draw.polygon([({x0}, {y1}), ({(x0 + x1) // 2}, {y0}), ({x1}, {y1})], fill="{col}")')
        else:
            lines.append(f'draw.{kind}(({x0}, {y0}, {x1}, {y1}), fill="{col}", outline="black")')
    return "\n".join(lines) + "\n"


def plot_program(rng: random.Random) -> str:
    w, h = rng.choice(SIZES[2:]), rng.choice(SIZES[1:])
    fn = rng.choice(("math.sin", "math.cos"))
    amp, period, col = rng.randint(h // 6, h // 2 - 4), rng.randint(6, 24), rng.choice(COLORS)
    return "\n".join([
        "import math", "", "from PIL import Image, ImageDraw", "",
        f'img = Image.new("RGB", ({w}, {h}), "white")', "draw = ImageDraw.Draw(img)",
        f'draw.line((0, {h // 2}, {w - 1}, {h // 2}), fill="gray")',
        f"points = [(x, {h // 2} - {amp} * {fn}(x / {period})) for x in range({w})]",
        f'draw.line(points, fill="{col}", width=2)', ""])


def clip_frames(rng: random.Random) -> tuple[list[Image.Image], str]:
    size = rng.choice(SIZES[:3])
    n, col, shape = rng.randint(2, 4), rng.choice(COLORS), rng.choice(("square", "circle"))
    direction = rng.choice(("right", "left", "down", "up"))
    r = size // 6
    frames = []
    for k in range(n):
        f = (k + 0.5) / n
        a = int(r + f * (size - 2 * r)) if direction in ("right", "down") else int(size - r - f * (size - 2 * r))
        cx, cy = (a, size // 2) if direction in ("right", "left") else (size // 2, a)
        im = Image.new("RGB", (size, size), "white")
        draw = ImageDraw.Draw(im)
        box = (cx - r, cy - r, cx + r, cy + r)
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=col)
        frames.append(im)
    return frames, f" A {col} {shape} moves {direction} over {n} frames."


def shape_picture(rng: random.Random) -> tuple[Image.Image, str]:
    """A white picture of 56..112 px with one square or circle of a palette colour, 1/2 to 4/5 of the picture
    across, anywhere it fits; the caption names the colour and the shape."""
    size, col, shape = rng.choice(SIZES[:3]), rng.choice(COLORS), rng.choice(("square", "circle"))
    r = rng.randint(size // 4, 2 * size // 5)
    cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
    im = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(im)
    (draw.rectangle if shape == "square" else draw.ellipse)((cx - r, cy - r, cx + r, cy + r), fill=col)
    return im, f" A {col} {shape}."


def build_samples(seed: int = 0, n_ocr: int = 160, n_code: int = 120, n_video: int = 40, n_picture: int = 0
                  ) -> list[tuple[str, list[Any], list[bytes]]]:
    """The samples ``[(key, sequence, pngs)]`` in a deterministic interleaved order. ``n_picture`` (not in the
    shipped corpus) adds that many captioned shape pictures; at 0 the samples are exactly those without it."""
    rng = random.Random(seed)
    verses = [line.split(" ", 1)[1] for d in itertools.islice(read_documents(DEFAULT_CORPUS), 60)
              for line in d.text.splitlines()[2:] if " " in line]
    kinds = ["ocr"] * n_ocr + ["code"] * n_code + ["video"] * n_video + ["picture"] * n_picture
    rng.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        if kind == "ocr":
            seq: list[Any] = ["Read the page:\n"]
            pngs = []
            for k in range(1 if rng.random() < 0.75 else 2):
                j = rng.randrange(len(verses) - 3)
                im, text = render_text(" ".join(verses[j:j + rng.randint(1, 3)]), rng.choice(SIZES[2:]))
                seq += [{"image": len(pngs)}, "\n" + text + "\n"]
                pngs.append(png_bytes(im))
        elif kind == "code":
            code = plot_program(rng) if rng.random() < 0.4 else shape_program(rng)
            seq = [{"image": 0}, "\nThe Python program that drew this picture:\n```python\n" + code + "```\n"]
            pngs = [png_bytes(run_drawing(code))]
        elif kind == "picture":
            im, caption = shape_picture(rng)
            seq = ["A picture:\n", {"image": 0}, caption + "\n"]
            pngs = [png_bytes(im)]
        else:
            frames, caption = clip_frames(rng)
            seq = ["A short clip:\n", {"video": list(range(len(frames)))}, caption + "\n"]
            pngs = [png_bytes(f) for f in frames]
        out.append((f"{kind}{i:05d}", seq, pngs))
    return out


def build_shipped_shards(root: str | Path, seed: int = 0, num_shards: int = 4, **counts: int) -> int:
    """Write the shipped corpus as an Energon dataset in ``root``; returns the number of samples."""
    root = Path(root)
    samples = build_samples(seed, **counts)
    per = -(-len(samples) // num_shards)
    shard_counts = {}
    for k in range(num_shards):
        rel = f"shards/shard_{k:03d}.tar"
        shard_counts[rel] = write_shard(root / rel, samples[k * per:(k + 1) * per])
    write_energon_meta(root, shard_counts)
    return len(samples)
