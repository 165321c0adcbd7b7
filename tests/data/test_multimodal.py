"""Multimodal data: Energon shards round trip, placeholder expansion, row packing without cut media spans, the
same global batch for any layout, exact resume, and the shipped corpus."""
from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from k3train.data.batch import Batch
from k3train.data.dataset import bin_path, validate_indexed_dataset
from k3train.data.loader import GlobalBatchLoader
from k3train.data.multimodal.dataset import cut_document
from k3train.data.multimodal.media_store import MediaStore, to_patches
from k3train.data.multimodal.prepare import prepare_multimodal
from k3train.data.multimodal.shards import read_energon, shard_list, write_energon_meta, write_shard
from k3train.data.multimodal.shipped import build_samples, run_drawing
from k3train.data.tokenizer import load_tokenizer
from k3train.model.media import merged_tokens, patch_grid
from mm_helpers import PH, mm_cfg, picture, small_shipped, vl_tok, write_dataset

ROW_FIELDS = ("tokens", "labels", "loss_mask", "doc_ids", "positions", "mtp_labels", "mtp_loss_mask")


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    return small_shipped(tmp_path_factory.mktemp("mm"))


def assert_same(a: Batch, b: Batch) -> None:
    for k in ROW_FIELDS:
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert torch.equal(a.media.grid_thw, b.media.grid_thw) and torch.equal(a.media.pixel_values, b.media.pixel_values)
    assert torch.equal(a.media_rows, b.media_rows)


def test_vl_tokenizer_keeps_the_text_ids():
    text, vl = load_tokenizer(), vl_tok()
    s = "In the beginning God created the heaven and the earth.\nimg = Image.new('RGB', (56, 56))"
    assert vl.encode(s) == text.encode(s) and text.vocab_size == 4096 and vl.vocab_size == 4099
    assert vl.media_id == PH and [vl._tok.token_to_id(t) for t in ("<|media_start|>", "<|media_end|>")] == [4097, 4098]


def test_shard_round_trip(tmp_path):
    samples = [("a0", ["hello ", {"image": 0}, " world"], [picture(56, 84, 1)]),
               ("b1", [{"video": [0, 1]}, "clip"], [picture(56, 56, 2), picture(56, 56, 3)])]
    root = write_dataset(tmp_path / "ds", samples)
    meta = root / ".nv-meta"
    assert yaml.safe_load((meta / ".info.yaml").read_text()) == {"shard_counts": {"shards/shard_000.tar": 2}}
    assert yaml.safe_load((meta / "split.yaml").read_text())["split_parts"]["train"] == ["shards/shard_000.tar"]
    assert yaml.safe_load((meta / "dataset.yaml").read_text())["__class__"] == "CrudeWebdataset"
    with tarfile.open(root / "shards/shard_000.tar") as tar:  # WebDataset member naming
        assert tar.getnames() == ["a0.json", "a0.0.png", "b1.json", "b1.0.png", "b1.1.png"]
    back = list(read_energon(root))
    assert [(s.key, s.sequence, [s.pictures[n] for n in sorted(s.pictures)]) for s in back] == samples
    # Energon's brace patterns in split.yaml
    write_shard(root / "shards/shard_001.tar", samples[:1])
    write_energon_meta(root, {"shards/shard_000.tar": 2, "shards/shard_001.tar": 1},
                       {"train": ["shards/shard_{000..001}.tar"], "val": [], "test": []})
    assert [s.key for s in read_energon(root)] == ["a0", "b1", "a0"]
    assert [p.name for p, _ in shard_list(root)] == ["shard_000.tar", "shard_001.tar"]


def test_placeholders_expanded_exactly(tmp_path):
    # the seed's table, through the one rule the encoder also uses
    for px, n in ((448, 256), (1792, 4096), (3584, 16384), (56, 4), (224, 64)):
        assert merged_tokens(*patch_grid(px, px)) == n
    samples = [("s0", ["a", {"image": 0}, "b", {"image": 1}], [picture(448, 448, 1), picture(84, 56, 2)]),
               ("s1", [{"video": [0, 1, 2]}, "c", {"image": 3}], [picture(56, 56, k) for k in range(3)]
                + [picture(130, 100, 4)])]  # 130 x 100 px is resized to 140 x 112: grid 8 x 10 -> 20 tokens
    tok = vl_tok()
    info, n_media = prepare_multimodal(write_dataset(tmp_path / "ds", samples), tok, tmp_path / "mm")
    assert n_media == 4 and info.num_documents == 2
    data = np.memmap(bin_path(tmp_path / "mm"), dtype=info.dtype, mode="r")
    docs = np.split(np.asarray(data), np.cumsum(info.sequence_lengths)[:-1])
    a, b = tok.encode("a"), tok.encode("b")
    assert docs[0].tolist() == a + [4097] + [PH] * 256 + [4098] + b + [4097] + [PH] * 6 + [4098] + [tok.eos_id]
    assert docs[1].tolist() == [4097] + [PH] * 4 + [4098] + tok.encode("c") + [4097] + [PH] * 20 + [4098] + [tok.eos_id]
    store = MediaStore(tmp_path / "mm")
    assert [store.grid(i) for i in range(4)] == [(1, 32, 32), (1, 4, 6), (3, 4, 4), (1, 8, 10)]
    orig = np.asarray(Image.open(io.BytesIO(picture(84, 56, 2))).convert("RGB"))
    assert np.array_equal(store.pixels(1)[0], orig)  # stored losslessly when no resize is needed
    mi = store.inputs([1, 2])
    assert mi.num_tokens() == 6 + 4 and mi.pixel_values.shape == (24 + 48, 3, 14, 14)
    # patch (t, h, w) = (0, 1, 2) of media 1: rows 14..28, columns 28..42, normalised with mean = std = 0.5
    want = (torch.from_numpy(orig[14:28, 28:42].astype(np.float32)).permute(2, 0, 1) / 255 - 0.5) / 0.5
    assert torch.allclose(to_patches(store.pixels(1))[1 * 6 + 2], want)


def test_cut_document_never_inside_a_span():
    spans = [(3, 10), (12, 20)]
    assert cut_document(30, spans, 8) == [(0, 3), (3, 11), (11, 12), (12, 20), (20, 28), (28, 30)]
    assert cut_document(30, [(5, 9)], 10) == [(0, 10), (10, 20), (20, 30)]
    assert cut_document(5, spans[:1], 8) == [(0, 5)]
    with pytest.raises(ValueError, match="does not fit a row of 6"):
        cut_document(30, spans, 6)


def test_rows_keep_media_whole_and_masks(shipped):
    cfg = mm_cfg(shipped, gbs=16, mbs=4, seq_len=96, steps=4)
    loader = GlobalBatchLoader(cfg)
    ds, tok = loader.dataset, loader.tokenizer
    # every document's tokens appear exactly once per epoch, in whole-document pieces
    total = sum(e - b for r in ds.rows for (_, b, e) in r)
    assert ds.num_epochs == 1 and total == ds.mm.info.num_tokens
    seen_media = []
    for i in range(len(ds)):
        row, media = ds.row(i)
        seen_media += media
        runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[0], (row[:-1] == PH).astype(int), [0]]))))[::2]
        assert runs.tolist() == ds.mm.num_tokens[media].tolist()  # whole runs, among the T input positions
        assert row[-1] != PH
    assert sorted(seen_media) == list(range(len(ds.store)))  # every media once
    batch = loader.global_batch(0)
    assert batch.media.num_tokens() == int((batch.tokens == PH).sum())
    assert not ((batch.labels == PH) & (batch.loss_mask > 0)).any()  # never predict an encoder slot
    assert not ((batch.mtp_labels == PH) & (batch.mtp_loss_mask > 0)).any()
    assert not ((batch.tokens == tok.pad_id) & (batch.loss_mask > 0)).any()


def test_same_global_batch_for_any_layout(shipped):
    cfg = mm_cfg(shipped, gbs=8, mbs=2, seq_len=96, steps=3)
    ref = GlobalBatchLoader(cfg)
    for step in range(2):
        full = ref.global_batch(step * 8)
        for dp in (1, 2, 4):
            loaders = [GlobalBatchLoader(cfg, dp_rank=r, dp=dp, tokenizer=ref.tokenizer) for r in range(dp)]
            for lo in loaders:
                lo.consumed_samples = step * 8
            got = Batch.cat([mb for lo in loaders for mb in lo.next_step()])
            assert_same(got, full)
        # cp = 2: each rank gets half of every row and ALL of its media
        halves = [GlobalBatchLoader(cfg, cp_rank=c, cp=2, consumed_samples=step * 8, tokenizer=ref.tokenizer)
                  .next_step() for c in range(2)]
        for m0, m1 in zip(*halves):
            assert m0.tokens.shape[1] == 48 and torch.equal(m0.media.pixel_values, m1.media.pixel_values)
        got = Batch.cat([Batch.cat([m0, m1], dim=1) for m0, m1 in zip(*halves)])
        assert_same(got, full)


def test_micro_batch_without_media_gets_empty_inputs(shipped):
    cfg = mm_cfg(shipped, gbs=8, mbs=1, seq_len=96, steps=3)
    ds = GlobalBatchLoader(cfg).dataset
    text_only = next(i for i in range(len(ds)) if not ds.row(i)[1])
    b = ds.batch(np.array([text_only]))
    assert b.media is not None and b.media.num_media == 0 and b.media.pixel_values.shape == (0, 3, 14, 14)
    two = ds.batch(np.array([text_only, next(i for i in range(len(ds)) if ds.row(i)[1])]))
    first, second = two.micro_batches(1)
    assert first.media.num_media == 0 and second.media.num_media == len(two.media_rows)


def test_resume_reproduces_the_batches(shipped):
    cfg = mm_cfg(shipped, gbs=4, mbs=2, seq_len=96, steps=6)
    a = GlobalBatchLoader(cfg, dp_rank=1, dp=2)
    steps = [a.next_step() for _ in range(4)]
    state = GlobalBatchLoader(cfg, dp_rank=1, dp=2, tokenizer=a.tokenizer)
    for _ in range(2):
        state.next_step()
    b = GlobalBatchLoader(cfg, dp_rank=1, dp=2, tokenizer=a.tokenizer)
    b.load_state_dict(state.state_dict())
    for want in steps[2:]:
        for x, y in zip(b.next_step(), want):
            assert_same(x, y)


def test_shipped_corpus_is_deterministic_and_paired():
    one, two = build_samples(3, n_ocr=6, n_code=6, n_video=3), build_samples(3, n_ocr=6, n_code=6, n_video=3)
    assert one == two
    kinds = {k[:-5] for k, _, _ in one}
    assert kinds == {"ocr", "code", "video"}
    for key, seq, pngs in one:
        if key.startswith("code"):  # the caption is the program, and running it gives the stored picture
            code = seq[1].split("```python\n")[1].split("```")[0]
            im = Image.open(io.BytesIO(pngs[0]))
            assert np.array_equal(np.asarray(im.convert("RGB")), np.asarray(run_drawing(code).convert("RGB")))
        for p in pngs:
            w, h = Image.open(io.BytesIO(p)).size
            assert w % 28 == 0 and h % 28 == 0 and 56 <= min(w, h) and max(w, h) <= 224
        if key.startswith("video"):
            assert 2 <= len(seq[1]["video"]) <= 4


def test_shipped_pictures_show_what_their_caption_says():
    """The optional picture kind (not in the shipped corpus): one still picture, then a caption naming the colour
    and the shape it shows -- every non-white pixel has the caption's colour, a square fills its bounding box and a
    circle does not."""
    from PIL import ImageColor

    samples = build_samples(5, n_ocr=0, n_code=0, n_video=0, n_picture=12)
    assert {k[:-5] for k, _, _ in samples} == {"picture"}
    shapes = set()
    for _, seq, pngs in samples:
        assert seq[1] == {"image": 0} and len(pngs) == 1 and seq[2].endswith(".\n")
        colour, shape = seq[2].split()[1], seq[2].split()[2].rstrip(".")
        px = np.asarray(Image.open(io.BytesIO(pngs[0])).convert("RGB"))
        ink = (px != 255).any(-1)
        assert (px[ink] == ImageColor.getrgb(colour)).all()
        ys, xs = np.nonzero(ink)
        box = ink[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
        assert box.all() == (shape == "square") and box.shape[0] >= px.shape[0] // 2 - 1
        shapes.add(shape)
    assert shapes == {"square", "circle"}


def test_prepared_dataset_validates(shipped):
    info = validate_indexed_dataset(shipped, 4099)
    assert info.num_documents == 80


def test_vision_bench_scores_the_text_after_media_and_keeps_noise_statistics():
    """benchmarks/bench_vision_learns.py: the scored labels are the text after a document's first <|media_end|>
    (no media tokens, specials or masked positions); the noise media keep the shapes and take the per-channel
    mean and std of all the media together, the same for every media (not each one's own: a picture's mean
    colour would tell its colour)."""
    from k3train.model.media import MediaInputs
    from benchmarks.bench_vision_learns import noise_like, pixel_stats, text_after_media_mask

    # doc 0: text, <|media_start|>, 2 placeholders, <|media_end|>, text, text, EOS; doc 1: text with no media
    b = Batch.from_samples(torch.tensor([[5, 4097, PH, PH, 4098, 6, 7, 1, 8, 9]]), eos_id=1, pad_id=2)
    mask = text_after_media_mask(b, 4098, PH, {0, 1, 2, PH})
    assert mask.tolist() == [[0, 0, 0, 0, 1, 1, 0, 0, 0]]  # labels 6, 7 (EOS and doc 1 are not scored)
    g = torch.Generator().manual_seed(0)
    px = torch.cat([torch.randn(64, 3, 14, 14, generator=g) * 0.5 + 2, torch.rand(16, 3, 14, 14, generator=g)])
    media = MediaInputs(px, torch.tensor([[1, 8, 8], [1, 4, 4]]))
    other = MediaInputs(torch.rand(16, 3, 14, 14, generator=g) - 1, torch.tensor([[1, 4, 4]]))
    mean, std = pixel_stats([media, other])
    every = torch.cat([px, other.pixel_values]).double()
    torch.testing.assert_close(mean, every.mean(dim=(0, 2, 3)))
    torch.testing.assert_close(std, every.transpose(0, 1).reshape(3, -1).std(1))
    noisy = noise_like(media, 3, mean, std)
    assert noisy.pixel_values.shape == px.shape and noisy.pixel_values.dtype == px.dtype
    assert torch.equal(noisy.grid_thw, media.grid_thw)
    n = noisy.pixel_values.double()
    torch.testing.assert_close(n.mean(dim=(0, 2, 3)), mean, atol=0.02, rtol=0)
    torch.testing.assert_close(n.transpose(0, 1).reshape(3, -1).std(1), std, atol=0.02, rtol=0.02)
    for sl in (slice(0, 64), slice(64, 80)):
        assert (noisy.pixel_values[sl] - px[sl]).abs().mean() > 0.1  # not the picture
    assert torch.equal(noise_like(media, 3, mean, std).pixel_values, noisy.pixel_values)  # the same every time


def test_vision_bench_image_dependent_words_follow_the_generator():
    """benchmarks/bench_vision_learns.py: the "image-dependent" tokens are exactly a clip caption's colour, shape and
    direction and a drawing's palette fills and background (checked against the program's own AST), found in the
    re-tokenized document; a document that is not its sample's tokens is refused."""
    import ast

    from k3train.data.multimodal.shipped import COLORS
    from benchmarks.bench_vision_learns import document_image_tags, image_dependent_spans, sample_kind

    tok = vl_tok()
    seen = set()
    for key, seq, _ in build_samples(3, n_ocr=2, n_code=6, n_video=3, n_picture=3):
        kind, text = sample_kind(key), seq[-1]
        seen.add(kind)
        words = [text[a:b] for a, b in image_dependent_spans(kind, text)]
        if kind == "video":
            colour, shape, _, direction = text.split()[1:5]
            assert words == [colour, shape, direction] and colour in COLORS
        elif kind == "picture":
            colour, shape = text.split()[1:3]
            assert words == [colour, shape.rstrip(".")] and colour in COLORS
        elif kind == "code":
            calls = [n for n in ast.walk(ast.parse(text.split("```python\n")[1].split("```")[0]))
                     if isinstance(n, ast.Call)]
            expect = [c.args[2].value for c in calls if getattr(c.func, "attr", "") == "new"]
            expect += [k.value.value for c in calls for k in c.keywords if k.arg == "fill" and k.value.value in COLORS]
            assert sorted(words) == sorted(expect) and len(expect) >= 2
        else:
            assert kind == "ocr" and words == []
        if kind != "ocr":  # one media: [text], <|media_start|>, 2 placeholders, <|media_end|>, text, EOS
            head = [t for el in seq[:-1] if isinstance(el, str) for t in tok.encode(el)]
            doc = np.asarray(head + [4097, PH, PH, 4098] + tok.encode(text) + [tok.eos_id])
            at = len(head)
            tags = document_image_tags(tok, kind, seq, doc, [(at, at + 4)])
            assert tok.decode(doc[tags].tolist()).replace(" ", "") == "".join(words)
            with pytest.raises(RuntimeError):
                document_image_tags(tok, kind, seq, doc[:-2], [(at, at + 4)])
    assert seen == {"ocr", "code", "video", "picture"}


def _vision_bench_json(out, capsys, *extra: str) -> tuple[int, dict]:
    """A small real run of benchmarks/bench_vision_learns.py in this process (400 pictures, 60 steps of 4 rows at a
    higher learning rate than the config's, so the vision path learns in that time), everything under ``out``."""
    import json

    from benchmarks.bench_vision_learns import main

    rc = main(["--out", str(out), "--picture", "400", "--video", "0", "--steps", "60", "--eval-every", "60",
               "--train.global_batch_size=4", "--train.micro_batch_size=4", "--optim.lr=6e-3", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_vision_bench_passes_when_the_vision_path_works(tmp_path, capsys):
    """benchmarks/bench_vision_learns.py on a working vision path: the caption's colour and shape words become much
    more likely with the real picture than with noise (the text around them does not), and the tool exits 0."""
    rc, res = _vision_bench_json(tmp_path, capsys)
    first, last = (e["groups"] for e in (res["evals"][0], res["evals"][-1]))
    assert res["ok"] and rc == 0, res["verdict"]
    assert last["img"]["tokens"] > 100 and last["img"]["gap"] - first["img"]["gap"] > max(0.15, 4 * last["img"]["se"])
    assert last["img"]["real"] < first["img"]["real"] and abs(last["text"]["gap"]) < 0.05


def test_vision_bench_fails_when_the_encoder_output_is_zeroed(tmp_path, capsys):
    """The negative control: the same run with the vision tower's output zeroed (--break-vision zero-encoder, a
    forward hook) learns the text but gets nothing from the pixels -- the gap is exactly 0 -- and exits 1."""
    rc, res = _vision_bench_json(tmp_path, capsys, "--break-vision", "zero-encoder")
    assert rc == 1 and not res["ok"] and res["break_vision"] == "zero-encoder", res["verdict"]
    assert all(e["groups"][g]["gap"] == 0.0 for e in res["evals"] for g in ("all", "img"))
    assert res["evals"][-1]["groups"]["img"]["real"] < res["evals"][0]["groups"]["img"]["real"] - 5  # it trained
