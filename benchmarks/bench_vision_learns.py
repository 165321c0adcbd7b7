#!/usr/bin/env python
"""Does the vision path learn? Train tiny-vl on a fresh corpus from the shipped multimodal generator whose text
right after each media names what only the pixels show, and compare, on held-out rows, the loss of that text with
the real pixels and with noise in their place.

    .venv/bin/python benchmarks/bench_vision_learns.py [--config configs/tiny-vl.yaml] [--steps 150] [--eval-every 50]
        [--picture 1200] [--video 400] [--ocr 0] [--code 0] [--corpus-seed 1] [--eval-rows 0] [--min-gap 0.1]
        [--break-vision none|zero-encoder] [--out DIR] [--json] [--section.key=value ...]

The corpus: the shipped generator (:mod:`k3train.data.multimodal.shipped`) with ``--picture`` captioned shape
pictures (a kind the shipped corpus does not hold), ``--video`` clips, ``--ocr`` rendered passages and ``--code``
drawings (the shipped corpus: 0 / 40 / 160 / 120) and seed ``--corpus-seed`` (the shipped corpus is seed 0),
written as Energon shards and prepared exactly as ``tools/prepare_data.py --shipped-multimodal`` (``make
data-mm``) does, with the config's tokenizer, into ``DIR/data`` (a temporary directory unless ``--out``);
``data.path`` points there (a ``--data.path`` override is refused). ``data.split`` defaults to ``90,10,0`` and
``train.micro_batch_size`` to 8 (one micro-batch per step: the gradient of the config's 4 x 2 rows, faster on one
core). The header says how many epochs of the train split the run reads.

Why pictures and clips: each is a media of 56..112 px (4..16 LM tokens) followed at once by a short caption whose
words the generator draws independently of all text, so only the pixels say them: a picture's ``A <red>
<square>.`` (colour 1 of 8, shape 1 of 2; the shape is half to four fifths of the picture across), a clip's
``A <red> <square> moves <left> over 3 frames.`` (the shape a third across; direction 1 of 4). About four
documents fit in a 128-token row, so nearly every caption is scored in the row that holds its media, and the
~160 valid documents give ~800 such tokens. The shipped mix is a poor test at ``seq_len`` 128: a drawing's colours
sit inside a program of ~150 tokens after a media of up to 64, so most of them fall in the next row (without the
picture); its 40 clips give a valid split of ~4 captions; OCR transcriptions can be recited from memory.
``--ocr`` / ``--code`` add those kinds back (reported per kind).

The run: the real trainer in this process (:class:`k3train.trainer.Trainer`, one process, the config's layout
must be world size 1); nothing is checkpointed. Evaluation at step 0 (before any update: the control), every
``--eval-every`` steps and at the end, on the first ``--eval-rows`` rows (0: all) of the VALID split (documents
training never sees), forward only through the runner's ``forward_only`` in eval mode, the same rows each time.
Per-token cross-entropies are read from the LM head's input (a hook on the final norm) and checked against the
runner's ``lm_loss_sum``. Two passes:

* ``real``: the rows as they are;
* ``noise``: every media's pixels replaced by Gaussian noise of the same shape, with the per-channel mean and std
  of all the scored media together (fixed seed: the same noise at every evaluation). Shape, frame count and
  placeholder count are kept, so only what the pixels SHOW differs. (Not each media's own mean: a picture's mean
  colour would tell its colour word.)

``gap = noise CE - real CE`` (nats per token, mean over the group's tokens; a paired difference: the same tokens
in both passes) for the groups:

* ``all``: every label that is a text token (not a media / BOS / EOS / pad token) after the first
  ``<|media_end|>`` of its document within the row (a document cut across rows is scored only in the row that
  holds its media): the caption, the transcription, the drawing's program;
* ``ocr`` / ``code`` / ``video`` / ``picture``: ``all`` restricted to one sample kind (the Energon sample key's
  prefix, ``ocr00012``; the prepared documents are the shards' samples in reading order, and every scored
  document is re-tokenized from its shard sample and checked equal to the prepared tokens);
* ``img``: the tokens of the words that only the pixels determine, located by the generator's own templates:
  ``img_pic``, a picture caption's colour and shape;
  ``img_clip``, a clip caption's colour, shape and direction (not the frame count, which the noise keeps);
  ``img_draw``, a drawing program's random colours: each ``fill="<colour>"`` from the generator's palette (the
  plot's fixed grey axis is not in it) and the background of ``Image.new``. ``img`` is their union. (OCR
  transcriptions are image-determined too, but a memorised verse continues without the page: they are reported
  as ``ocr`` only.) Every sub-word token of such a word counts (``s`` ``qu`` ``are``: the later ones follow from
  the first, so a learned word's gap sits on its first token and the mean is over all).
* ``text``: ``all`` but ``img`` (``A``, ``moves``, ``over 3 frames``, ...): words the text determines; their gap
  stays near 0 when the model reads the pixels rather than being merely disturbed by noise.

``±se``: the standard error of the gap with the tokens of one document in one row as a cluster.

``--break-vision zero-encoder`` (the negative control): a forward hook on every vision tower (encoder + merge +
projector) of the model replaces its output by zeros, so the LM gets the same placeholder embeddings whatever the
pixels; the model code is unchanged and the hook is checked to have run. Such a run must FAIL.

Pass rule: on ``img``, the final gap minus the step-0 gap must exceed ``--min-gap`` (0.1 nats per token) AND
twice the standard error of that difference (``2 * sqrt(se_0^2 + se_final^2)``). Exit 0 on pass, 1 on fail,
2 on bad input (reported before training starts). A table is printed (``--json``: one object with every
evaluation and group).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3train.data.multimodal.dataset import build_multimodal_dataset  # noqa: E402
from k3train.data.multimodal.prepare import prepare_multimodal  # noqa: E402
from k3train.data.multimodal.shards import read_energon  # noqa: E402
from k3train.data.multimodal.shipped import COLORS, build_samples, build_shipped_shards  # noqa: E402
from k3train.data.multimodal.validate import vision_geometry  # noqa: E402
from k3train.data.multimodal.vl_tokenizer import MEDIA_END, MEDIA_PAD  # noqa: E402
from k3train.data.tokenizer import load_config_tokenizer  # noqa: E402
from k3train.model.media import MediaInputs  # noqa: E402
from k3train.model.vit_tower import VisionTower  # noqa: E402
from k3train.preflight import validate_run  # noqa: E402
from k3train.runtime.bad_input import is_bad_input, report_bad_input  # noqa: E402
from k3train.trainer import Trainer  # noqa: E402
from parallel.pipeline.loss_norm import LossNorm  # noqa: E402

# a valid split of ~10% of the corpus's documents; one micro-batch per step (the gradient of the config's 4 x 2
# rows, ~25% faster on one core); user overrides win
DEFAULTS = ["--data.split=90,10,0", "--train.micro_batch_size=8"]
FIXED = ["--checkpoint.resume=none", "--checkpoint.save_final=false", "--checkpoint.interval=0",
         "--checkpoint.overwrite=true", "--logging.wandb=false", "--logging.level=WARNING",
         "--logging.peak_flops=1e12", "--train.eval_interval=0"]
KINDS = ("ocr", "code", "video", "picture")  # the shipped generator's sample kinds (key prefixes)
IMG_GROUPS = {"picture": "img_pic", "video": "img_clip", "code": "img_draw"}  # kinds with image-dependent words
GROUPS = ("all", "text", *KINDS, "img", *IMG_GROUPS.values())
PASS_GROUP = "img"
CORPUS = {"picture": 1200, "video": 400, "ocr": 0, "code": 0}  # this tool's default corpus (see the module docstring)
STEPS, EVAL_EVERY, MIN_GAP = 150, 50, 0.1


def _templates() -> tuple[re.Pattern, re.Pattern, re.Pattern, re.Pattern]:
    picture = re.compile(r"^ A (\w+) (\w+)\.\n?$")  # shipped.shape_picture's caption
    clip = re.compile(r"^ A (\w+) (\w+) moves (\w+) over \d+ frames\.")  # shipped.clip_frames' caption
    fill = re.compile(r'fill="(%s)"' % "|".join(map(re.escape, COLORS)))  # the random palette only
    background = re.compile(r'Image\.new\("RGB", \(\d+, \d+\), "(\w+)"\)')
    return picture, clip, fill, background


def image_dependent_spans(kind: str, text: str) -> list[tuple[int, int]]:
    """Character spans ``[(begin, end)]`` of the words of a text element of a ``kind`` sample that only the
    pixels determine (see the module docstring): a picture caption's colour and shape; a clip caption's colour,
    shape and direction; a drawing program's palette colours and background. ``[]`` for other kinds and texts."""
    picture, clip, fill, background = _templates()
    if kind == "picture":
        m = picture.match(text)
        return [m.span(g) for g in (1, 2)] if m else []
    if kind == "video":
        m = clip.match(text)
        return [m.span(g) for g in (1, 2, 3)] if m else []
    if kind == "code":
        return sorted([m.span(1) for m in fill.finditer(text)] + [m.span(1) for m in background.finditer(text)])
    return []


def sample_kind(key: str) -> str:
    """The kind of a shipped sample from its key (``video00007`` -> ``video``); ``""`` for another key."""
    m = re.match(r"([a-z]+)\d+$", key)
    return m.group(1) if m and m.group(1) in KINDS else ""


def document_image_tags(tok: Any, kind: str, sequence: list[Any], doc: Any, media_spans: list[tuple[int, int]]
                        ) -> Any:
    """``[len(doc)]`` bool: the tokens of the prepared document ``doc`` that belong to an image-dependent word.
    Re-tokenizes the shard ``sequence`` as preparation does (each text element on its own; the media spans at
    ``media_spans``, EOS last) and raises if that does not give ``doc`` back."""
    ids: list[int] = []
    tags: list[bool] = []
    spans = iter(media_spans)
    for el in sequence:
        if isinstance(el, str):
            enc = tok._tok.encode(el, add_special_tokens=False)
            words = image_dependent_spans(kind, el)
            ids += enc.ids
            tags += [any(a < we and wb < b for wb, we in words) for a, b in enc.offsets]
        else:
            lo, hi = next(spans, (-1, -1))
            if lo != len(ids):
                raise RuntimeError(f"document does not match its shard sample: media at {lo}, expected {len(ids)}")
            ids += [int(t) for t in doc[lo:hi]]
            tags += [False] * (hi - lo)
    ids.append(tok.eos_id)
    tags.append(False)
    if len(ids) != len(doc) or any(a != int(b) for a, b in zip(ids, doc)):
        raise RuntimeError("a prepared document differs from its re-tokenized shard sample: the dataset is not "
                           "the one this tool built")
    return np.asarray(tags, dtype=bool)


def text_after_media_mask(batch: Any, media_end_id: int, first_special_media_id: int,
                          special_ids: set[int]) -> Any:
    """``[B, T]`` float mask of the labels to score: text tokens (below the media ids, not a special token)
    after the first ``media_end_id`` token of their document, where the batch's own loss mask is on."""
    tokens, labels, doc = batch.tokens, batch.labels, batch.doc_ids
    seen = torch.zeros_like(tokens, dtype=torch.bool)
    for b in range(tokens.shape[0]):  # per row, per document: after its first media end
        ends = (tokens[b] == media_end_id).long()
        for d in doc[b].unique().tolist():
            in_doc = doc[b] == d
            seen[b] |= in_doc & (torch.cumsum(ends * in_doc.long(), 0) > 0)
    text = (labels < first_special_media_id) & ~torch.isin(labels, torch.tensor(sorted(special_ids)))
    return (seen & text).float() * batch.loss_mask


def pixel_stats(medias: list[Any]) -> tuple[Any, Any]:
    """Per-channel ``(mean [3], std [3])`` of every pixel value of ``medias`` (``MediaInputs``) together."""
    px = torch.cat([m.pixel_values.double().transpose(0, 1).reshape(3, -1) for m in medias], dim=1)
    return px.mean(1), px.std(1)


def noise_like(media: Any, seed: int, mean: Any, std: Any) -> Any:
    """``media`` with every pixel value replaced by Gaussian noise of per-channel ``mean`` / ``std`` (``[3]``;
    :func:`pixel_stats` of the whole evaluation set: statistics that say nothing about one media); the shapes and
    ``grid_thw`` are kept."""
    g = torch.Generator().manual_seed(seed)
    px = media.pixel_values
    z = torch.randn(px.shape, generator=g, dtype=torch.float64)
    out = (z * std.double().reshape(1, 3, 1, 1) + mean.double().reshape(1, 3, 1, 1)).to(px.dtype)
    return MediaInputs(out, media.grid_thw.clone())


def shipped_counts() -> dict[str, int]:
    """The shipped corpus's sample counts per kind (``build_samples``' defaults): ``{"video": 40, ...}``."""
    return {k[2:]: p.default for k, p in inspect.signature(build_samples).parameters.items() if k.startswith("n_")}


def build_corpus(cfg: Any, tok: Any, root: Path, counts: dict[str, int], seed: int) -> tuple[Path, Path]:
    """``(prefix, shard dir)``: the shipped generator's corpus with ``counts`` (``n_picture`` / ``n_video`` /
    ``n_ocr`` / ``n_code``) samples, built and prepared in ``root`` like ``tools/prepare_data.py --shipped-multimodal``
    (config's tokenizer, media limit and patch geometry)."""
    wds, prefix = root / "mm_wds", root / "mm"
    build_shipped_shards(wds, seed, **counts)
    patch, merge = vision_geometry(cfg)
    prepare_multimodal(wds, tok, prefix, int(cfg.data.max_media_pixels), patch, merge)
    return prefix, wds


def break_vision(modules: list[Any], how: str) -> list[int]:
    """Break the vision path of the model (its chunks ``modules``) from outside (``how``: ``zero-encoder``): a forward hook on every
    :class:`k3train.model.vit_tower.VisionTower` (encoder + merge + projector) returns zeros of its output's shape,
    so the placeholders' embeddings no longer depend on the pixels (and no gradient reaches the tower). Returns a
    one-element list counting the hook's calls (the caller checks it ran)."""
    if how != "zero-encoder":
        raise ValueError(f"--break-vision: unknown {how!r} (none, zero-encoder)")
    calls = [0]

    def zero(_m: Any, _i: Any, out: Any) -> Any:
        calls[0] += 1
        return torch.zeros_like(out)

    towers = [m for chunk in modules for m in chunk.modules() if isinstance(m, VisionTower)]
    if not towers:
        raise RuntimeError("--break-vision: the model has no vision tower to break")
    for m in towers:
        m.register_forward_hook(zero)
    return calls


@dataclasses.dataclass
class EvalSet:
    batches: list[Any]  # loss_mask = the "all" mask, no MTP targets
    masks: list[dict[str, Any]]  # per batch: group -> [B, T] float mask
    clusters: list[Any]  # per batch: [B, T] long, one id per (row, document piece)
    rows: int
    pixel_mean: Any = None  # [3]: pixel_stats of every media of the batches (the noise pass's statistics)
    pixel_std: Any = None

    def tokens(self, group: str) -> int:
        return int(sum(float(m[group].sum()) for m in self.masks))


def eval_set(cfg: Any, tok: Any, shard_dir: Path, rows: int, mbs: int) -> EvalSet:
    """The first ``rows`` rows (0: all) of the valid split as micro-batches, with every group's label mask."""
    ds = build_multimodal_dataset(cfg, tok, "valid", None)
    media_end, media_pad = tok._tok.token_to_id(MEDIA_END), tok._tok.token_to_id(MEDIA_PAD)
    if media_end is None or media_pad is None:
        raise ValueError(f"data.tokenizer {tok.path} has no {MEDIA_END} / {MEDIA_PAD}: not the vision tokenizer")
    n = len(ds) if rows == 0 else min(rows, len(ds))
    need = {d for i in range(n) for d, _, _ in ds.rows[i]}
    kind_of, img_of = {}, {}
    num_docs = 0
    for d, s in enumerate(read_energon(shard_dir)):  # preparation's order: document d is the d-th sample
        num_docs += 1
        if d in need:
            lo, hi = int(ds.media_lo[d]), int(ds.media_hi[d])
            spans = list(zip(ds.mm.span_start[lo:hi].tolist(), ds.mm.span_end[lo:hi].tolist()))
            doc = ds.tokens[int(ds.doc_start[d]):int(ds.doc_start[d + 1])]
            kind_of[d] = sample_kind(s.key)
            img_of[d] = document_image_tags(tok, kind_of[d], s.sequence, doc, spans)
            if kind_of[d] in IMG_GROUPS and not img_of[d].any():
                raise RuntimeError(f"{s.source}: no image-dependent word found: the generator's templates changed "
                                   "(update image_dependent_spans)")
    if num_docs != ds.mm.info.num_sequences:
        raise RuntimeError(f"{shard_dir} has {num_docs} samples but the dataset {num_docs} documents")
    special = set(tok.special_ids)
    out = EvalSet([], [], [], n)
    cluster = 0
    for lo in range(0, n, mbs):
        idx = list(range(lo, min(n, lo + mbs)))
        b = ds.batch(idx)
        kind = np.full((len(idx), ds.row_len), -1, dtype=np.int64)
        img = np.zeros((len(idx), ds.row_len), dtype=bool)
        clu = np.full((len(idx), ds.row_len), -1, dtype=np.int64)
        for r, i in enumerate(idx):
            pos = 0
            for d, p0, p1 in ds.rows[i]:
                kind[r, pos:pos + p1 - p0] = KINDS.index(kind_of[d]) if kind_of[d] else -1
                img[r, pos:pos + p1 - p0] = img_of[d][p0:p1]
                clu[r, pos:pos + p1 - p0] = cluster
                cluster += 1
                pos += p1 - p0
        # label t is row token t + 1
        kind_t, img_t = torch.from_numpy(kind[:, 1:]), torch.from_numpy(img[:, 1:]).float()
        every = text_after_media_mask(b, media_end, min(media_pad, media_end), special)
        m = {"all": every, **{k: every * (kind_t == j).float() for j, k in enumerate(KINDS)}}
        m["img"] = every * img_t
        m["text"] = every - m["img"]
        for k, g in IMG_GROUPS.items():
            m[g] = m["img"] * (kind_t == KINDS.index(k)).float()
        out.batches.append(dataclasses.replace(b, loss_mask=every, mtp_loss_mask=torch.zeros_like(b.mtp_loss_mask)))
        out.masks.append(m)
        out.clusters.append(torch.from_numpy(clu[:, 1:]))
    medias = [b.media for b in out.batches if b.media is not None and b.media.pixel_values.numel()]
    if medias:
        out.pixel_mean, out.pixel_std = pixel_stats(medias)
    for g in ("all", PASS_GROUP):
        if out.tokens(g) == 0:
            raise ValueError(f"the valid split's first {n} rows hold no {g!r} tokens to score: raise --eval-rows "
                             "or the corpus (--picture, --video)")
    return out


def token_ce(trainer: Any, es: EvalSet, noise: bool) -> list[Any]:
    """Per-label cross-entropy ``[B, T]`` of every micro-batch (``noise``: with :func:`noise_like` media), forward
    only through the runner with the model in eval mode. The LM head's input is read by a hook on the model's
    final norm; the masked sum is checked against the runner's ``lm_loss_sum``."""
    pm = trainer.pm
    model = pm.model
    modes = [m.training for m in pm.modules]
    for m in pm.modules:
        m.eval()
    norm = LossNorm(lm_tokens=1.0, mtp_tokens=1.0, mtp_weight=0.0)
    seen: list[Any] = []
    hook = model.norm.register_forward_hook(lambda _m, _i, o: seen.append(o.detach()))
    out = []
    try:
        with torch.no_grad():
            for k, b in enumerate(es.batches):
                if noise and b.media is not None and b.media.pixel_values.numel():
                    b = dataclasses.replace(b, media=noise_like(b.media, 1000 + k, es.pixel_mean, es.pixel_std))
                seen.clear()
                stats = pm.runner.forward_only([b.to(trainer.env.device)], norm)
                if len(seen) != 1:
                    raise RuntimeError(f"expected one call of the final norm per forward, got {len(seen)}")
                logits = model.lm_head(seen[0]).float()
                V = logits.shape[-1]
                ce = F.cross_entropy(logits.reshape(-1, V), b.labels.to(logits.device).reshape(-1).clamp(0, V - 1),
                                     reduction="none").reshape(b.labels.shape).cpu()
                ref, got = float(stats["lm_loss_sum"]), float((ce * b.loss_mask).sum())
                if abs(got - ref) > 1e-4 * max(1.0, abs(ref)):
                    raise RuntimeError(f"per-token CE sum {got} != the runner's lm_loss_sum {ref}")
                out.append(ce)
    finally:
        hook.remove()
        for m, was in zip(pm.modules, modes):
            m.train(was)
    return out


def group_stats(es: EvalSet, real: list[Any], noise: list[Any]) -> dict[str, dict[str, float]]:
    """Per group: mean ``real`` / ``noise`` CE, ``gap``, its document-clustered standard error ``se``, ``tokens``."""
    out = {}
    for g in GROUPS:
        m = torch.cat([mk[g].reshape(-1) for mk in es.masks])
        sel = m > 0
        r = torch.cat([x.reshape(-1) for x in real])[sel].double()
        z = torch.cat([x.reshape(-1) for x in noise])[sel].double()
        c = torch.cat([x.reshape(-1) for x in es.clusters])[sel]
        n = int(sel.sum())
        if n == 0:
            out[g] = {"real": math.nan, "noise": math.nan, "gap": math.nan, "se": math.nan, "tokens": 0}
            continue
        gap = float((z - r).mean())
        _, inv = torch.unique(c, return_inverse=True)
        d_c = torch.zeros(int(inv.max()) + 1, dtype=torch.float64).index_add_(0, inv, z - r)
        n_c = torch.zeros_like(d_c).index_add_(0, inv, torch.ones_like(r))
        k = d_c.numel()
        se = math.sqrt(k / (k - 1) * float(((d_c - gap * n_c) ** 2).sum())) / n if k > 1 else math.nan
        out[g] = {"real": float(r.mean()), "noise": float(z.mean()), "gap": gap, "se": se, "tokens": n}
    return out


def verdict(first: dict[str, Any], last: dict[str, Any], min_gap: float) -> tuple[bool, str]:
    """The pass rule of the module docstring on ``PASS_GROUP``."""
    a, b = first["groups"][PASS_GROUP], last["groups"][PASS_GROUP]
    diff, se = b["gap"] - a["gap"], math.sqrt(a["se"] ** 2 + b["se"] ** 2)
    need = max(min_gap, 2 * se)
    ok = math.isfinite(se) and diff > need  # no standard error (a single scored document): no verdict to trust
    return ok, (f"{'PASS' if ok else 'FAIL'}: {PASS_GROUP} gap {b['gap']:+.4f} at step {last['step']} vs "
                f"{a['gap']:+.4f} at step 0: {diff:+.4f} (needs > max(--min-gap {min_gap}, 2 se {2 * se:.4f}) "
                f"= {need:.4f})")


def _finite(x: Any) -> Any:
    """``x`` with every NaN / inf float as ``None`` (strict JSON)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _num(x: float, fmt: str, width: int) -> str:
    return f"{x:{fmt}}".rjust(width) if math.isfinite(x) else "-".rjust(width)


def print_table(evals: list[dict[str, Any]]) -> None:
    print(f"{'':>6} {'train':>7} | {'all tokens':^25} {'text':>8} | {'gap per kind':^35} | "
          f"{'image-dependent words':^51} |")
    print(f"{'step':>6} {'loss':>7} | {'real':>7} {'noise':>7} {'gap':>8} {'gap':>8} | "
          + " ".join(f"{k:>8}" for k in KINDS) + f" | {'real':>7} {'noise':>7} {'gap':>8} {'±se':>6} "
          + " ".join(f"{g[4:]:>8}" for g in IMG_GROUPS.values()) + f" | {'s':>6}")
    for e in evals:
        g = e["groups"]
        tl = "" if math.isnan(e["train_loss"]) else f"{e['train_loss']:.4f}"
        a, i = g["all"], g["img"]
        cells = [_num(a["real"], ".4f", 7), _num(a["noise"], ".4f", 7), _num(a["gap"], "+.4f", 8),
                 _num(g["text"]["gap"], "+.4f", 8), "|",
                 *(_num(g[k]["gap"], "+.4f", 8) for k in KINDS), "|", _num(i["real"], ".4f", 7),
                 _num(i["noise"], ".4f", 7), _num(i["gap"], "+.4f", 8), _num(i["se"], ".4f", 6),
                 *(_num(g[k]["gap"], "+.4f", 8) for k in IMG_GROUPS.values()), "|"]
        print(f"{e['step']:>6} {tl:>7} | " + " ".join(cells) + f" {e['seconds']:>6.1f}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmarks/bench_vision_learns.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-vl.yaml"))
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps (the LR schedule spans them)")
    ap.add_argument("--eval-every", type=int, default=EVAL_EVERY, help="evaluate every N steps (and at 0 and the "
                    "end)")
    ap.add_argument("--eval-rows", type=int, default=0, help="valid-split rows scored, the same every time (0: all)")
    shipped = shipped_counts()
    for kind, n in CORPUS.items():
        ap.add_argument(f"--{kind}", type=int, default=n, help=f"{kind} samples in the corpus built (the shipped "
                        f"corpus: {shipped[kind]})")
    ap.add_argument("--corpus-seed", type=int, default=1, help="the generator's seed (the shipped corpus: 0)")
    ap.add_argument("--min-gap", type=float, default=MIN_GAP, help="nats per token the image-dependent words' gap "
                    "must grow by from step 0 (and by more than 2 standard errors) for exit 0")
    ap.add_argument("--break-vision", choices=("none", "zero-encoder"), default="none", help="the negative control: "
                    "zero-encoder zeroes the vision tower's output (a forward hook); the run must then fail")
    ap.add_argument("--out", default="", help="directory for the corpus and the run (default: a temporary one, "
                    "removed)")
    ap.add_argument("--json", action="store_true")
    return ap


def _prepare(args: argparse.Namespace, overrides: list[str], out: Path, t0: float) -> tuple[Any, EvalSet, dict]:
    """Check the arguments, build and prepare the corpus, read the evaluation set: the run's config, the set and
    the run's description (bad input raises before any training)."""
    if args.steps < 1 or args.eval_every < 1 or args.eval_rows < 0:
        raise ValueError("--steps and --eval-every must be >= 1, --eval-rows >= 0")
    counts = {f"n_{k}": getattr(args, k) for k in CORPUS}
    if min(counts.values()) < 0 or not sum(counts[f"n_{k}"] for k in IMG_GROUPS):
        raise ValueError(f"--picture / --video / --ocr / --code must be >= 0, with some of "
                         f"{', '.join(IMG_GROUPS)} (the kinds with image-dependent words), got {counts}")
    if any(o.split("=", 1)[0] == "--data.path" for o in overrides):
        raise ValueError("--data.path: this tool trains on the corpus it builds (--picture, --video, --ocr, "
                         "--code, --corpus-seed), not on a given dataset")
    run = [*DEFAULTS, *overrides, *FIXED, f"--train.steps={args.steps}", f"--train.out_dir={out / 'run'}"]
    cfg = validate_run(args.config, run, world_size=1, for_training=False)
    if cfg.data.format != "multimodal" or not cfg.vision.enabled:
        raise ValueError(f"{args.config}: needs data.format=multimodal and vision.enabled=true")
    tok = load_config_tokenizer(cfg)
    prefix, wds = build_corpus(cfg, tok, out / "data", counts, args.corpus_seed)
    t_data = time.perf_counter() - t0
    cfg = validate_run(args.config, [*run, f"--data.path={prefix}"], world_size=1)
    es = eval_set(cfg, tok, wds, args.eval_rows, cfg.train.micro_batch_size)
    train_rows = len(build_multimodal_dataset(cfg, tok, "train", None))  # one epoch
    read = args.steps * cfg.train.global_batch_size
    head = {"config": args.config, "steps": args.steps, "break_vision": args.break_vision,
            "corpus_counts": counts, "corpus_seed": args.corpus_seed,
            "documents": int(sum(counts.values())), "train_rows_per_epoch": train_rows, "rows_read": read,
            "epochs_read": read / train_rows, "eval_rows": es.rows,
            "scored_tokens": {g: es.tokens(g) for g in GROUPS}, "data_s": round(t_data, 1)}
    return cfg, es, head


def _train_and_evaluate(cfg: Any, es: EvalSet, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train ``args.steps`` steps, evaluating at step 0, every ``args.eval_every`` steps and at the end."""
    t1 = time.perf_counter()
    tr = Trainer(cfg)
    hook_calls = break_vision(tr.pm.modules, args.break_vision) if args.break_vision != "none" else None
    evals: list[dict[str, Any]] = []
    losses: list[float] = []
    try:
        def evaluate() -> None:
            groups = group_stats(es, token_ce(tr, es, False), token_ce(tr, es, True))
            evals.append({"step": tr.step, "groups": groups, "seconds": round(time.perf_counter() - t1, 1),
                          "train_loss": sum(losses) / len(losses) if losses else math.nan})
            losses.clear()
            if not args.json:
                a, i = groups["all"], groups[PASS_GROUP]
                print(f"step {tr.step:>5}: all gap {a['gap']:+.4f}  {PASS_GROUP} gap {i['gap']:+.4f} "
                      f"± {i['se']:.4f}", flush=True)

        evaluate()  # step 0: the control
        if hook_calls is not None and hook_calls[0] == 0:
            raise RuntimeError("--break-vision: the hook on the vision tower never ran")
        while tr.step < args.steps:
            losses.append(float(tr.train_step().get("loss", math.nan)))
            if tr.step % args.eval_every == 0 or tr.step == args.steps:
                evaluate()
    finally:
        tr.close()
    return evals


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    t0 = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="k3vision_") if not args.out else None
    out = Path(args.out or tmp.name)
    try:
        try:
            cfg, es, head = _prepare(args, overrides, out, t0)
        except Exception as e:  # noqa: BLE001
            if not (is_bad_input(e) or isinstance(e, ValueError)):
                raise
            return report_bad_input(e)
        if not args.json:
            counts, read, train_rows = head["corpus_counts"], head["rows_read"], head["train_rows_per_epoch"]
            broken = "" if args.break_vision == "none" else f"; VISION BROKEN: {args.break_vision}"
            print(f"{args.config}{broken}: corpus {counts} (seed {args.corpus_seed}) built in {head['data_s']:.1f}s; "
                  f"training reads {read} rows = {read / train_rows:.2f} epochs of the train split ({train_rows} "
                  "rows)")
            print(f"scored on {es.rows} valid rows: " + ", ".join(f"{g} {n}" for g, n in
                                                                  head["scored_tokens"].items()) + " tokens",
                  flush=True)
        evals = _train_and_evaluate(cfg, es, args)
    finally:
        if tmp is not None:
            tmp.cleanup()
    ok, line = verdict(evals[0], evals[-1], args.min_gap)
    wall = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(_finite({**head, "evals": evals, "ok": ok, "verdict": line, "wall_s": wall}),
                         allow_nan=False))
    else:
        print(f"\nmean CE in nats per token; gap = noise - real; train loss: mean since the last evaluation; "
              f"s: since the trainer started (total wall {wall}s)")
        print_table(evals)
        print(line)
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
