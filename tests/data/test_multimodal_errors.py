"""Bad media input is ONE clear error, at preparation (tools/prepare_data.py) or at start-up (preflight, which every
entry point runs): ``k3train: error: ...``, exit 2, nothing started."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from k3train.cli import main as k3train_main
from k3train.data.corpus import DataError
from k3train.data.dataset import bin_path
from k3train.data.multimodal.media_store import HEIGHT, WIDTH, media_index_path
from k3train.data.multimodal.prepare import prepare_multimodal
from mm_helpers import PH, check_args, picture, vl_tok, write_dataset

ROOT = Path(__file__).resolve().parents[2]


def _prepare_tool():
    spec = importlib.util.spec_from_file_location("prepare_data_tool", ROOT / "tools" / "prepare_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.main


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Three documents: a 56 x 84 image, a 448 x 448 image, a 2-frame clip."""
    root = tmp_path_factory.mktemp("mmerr")
    samples = [("a", ["one ", {"image": 0}, " two"], [picture(84, 56, 1)]),
               ("b", [{"image": 0}, " three"], [picture(448, 448, 2)]),
               ("c", ["clip ", {"video": [0, 1]}], [picture(56, 56, 3), picture(56, 56, 4)])]
    write_dataset(root / "wds", samples)
    prepare_multimodal(root / "wds", vl_tok(), root / "mm")
    return root / "mm"


def copy_prepared(prefix: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for ext in (".bin", ".idx", ".meta.json", ".media.bin", ".media.npy"):
        shutil.copy(str(prefix) + ext, dst / (prefix.name + ext))
    return dst / prefix.name


def one_error(capsys, args: list[str], tmp_path: Path) -> str:
    assert k3train_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3train: error: "), err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    return err[0]


def test_prepare_tool_writes_the_same_dataset(prepared, tmp_path, capsys):
    out = tmp_path / "again"
    assert _prepare_tool()(["--multimodal", str(prepared.parent / "wds"), "--tokenizer",
                            "k3train/data/assets/tokenizer-vl.json", "--media-token", "<|media_pad|>",
                            "--output-prefix", str(out)]) == 0
    assert "3 documents" in capsys.readouterr().out
    for ext in (".bin", ".idx", ".media.bin", ".media.npy"):
        assert Path(str(out) + ext).read_bytes() == Path(str(prepared) + ext).read_bytes()


def test_good_dataset_passes_the_check(prepared, tmp_path, capsys):
    assert k3train_main(check_args(prepared, tmp_path / "run", "--train.seq_len=320")) == 0
    assert "valid" in capsys.readouterr().out


def test_corrupt_image_in_a_shard(tmp_path, capsys):
    bad = picture(56, 56, 1)
    bad = bad[:60] + bytes(len(bad) - 60)  # header intact, image data zeroed
    root = write_dataset(tmp_path / "wds", [("ok", ["x", {"image": 0}], [picture(56, 56, 2)]),
                                            ("broken", ["y", {"image": 0}], [bad])])
    with pytest.raises(DataError, match=r"shard_000.tar:broken.0.png: cannot decode image"):
        prepare_multimodal(root, vl_tok(), tmp_path / "mm")
    assert not Path(str(tmp_path / "mm") + ".bin").exists() and not media_index_path(tmp_path / "mm").exists()
    rc = _prepare_tool()(["--multimodal", str(root), "--tokenizer", "k3train/data/assets/tokenizer-vl.json",
                          "--media-token", "<|media_pad|>", "--output-prefix", str(tmp_path / "mm")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("k3train: error: ") and "broken.0.png" in err[0]


def test_missing_picture_and_large_image_at_preparation(tmp_path):
    root = write_dataset(tmp_path / "a", [("k", [{"image": 1}], [picture(56, 56)])])
    with pytest.raises(DataError, match=r"refers to picture 1 but the sample has no member k.1.png"):
        prepare_multimodal(root, vl_tok(), tmp_path / "mm")
    root = write_dataset(tmp_path / "b", [("big", [{"image": 0}], [picture(448, 448)])])
    with pytest.raises(DataError, match=r"big.0.png: image of 448x448 px .* larger than the limit of 100000 px"):
        prepare_multimodal(root, vl_tok(), tmp_path / "mm", max_media_pixels=100_000)


def test_image_larger_than_the_configured_limit(prepared, tmp_path, capsys):
    line = one_error(capsys, check_args(prepared, tmp_path / "run", "--train.seq_len=320",
                                        "--data.max_media_pixels=100000"), tmp_path)
    assert line.startswith("k3train: error: data.max_media_pixels: ") and "448x448 = 200704 px" in line


def test_placeholder_count_does_not_match_the_media(prepared, tmp_path, capsys):
    p = copy_prepared(prepared, tmp_path / "c")
    data = np.memmap(bin_path(p), dtype=np.uint16, mode="r+")
    data[int(np.flatnonzero(data == PH)[3])] = 100  # one placeholder of the first image becomes text
    data.flush()
    del data
    line = one_error(capsys, check_args(p, tmp_path / "run", "--train.seq_len=320"), tmp_path)
    assert line.startswith("k3train: error: data.path: ") and "media 0 (document 0, grid 1x4x6) needs exactly 6 " \
        "placeholder tokens" in line


def test_media_not_a_multiple_of_28(prepared, tmp_path, capsys):
    p = copy_prepared(prepared, tmp_path / "d")
    index = np.load(media_index_path(p))
    index[0, HEIGHT], index[0, WIDTH] = 42, 112  # 56 x 84 = 42 x 112 px: the bytes still add up
    np.save(media_index_path(p), index)
    line = one_error(capsys, check_args(p, tmp_path / "run", "--train.seq_len=320"), tmp_path)
    assert "media 0 (document 0) is 112x42 px: height and width must be multiples of patch_size * merge = 28" in line


def test_media_span_longer_than_a_row(prepared, tmp_path, capsys):
    line = one_error(capsys, check_args(prepared, tmp_path / "run", "--train.seq_len=128"), tmp_path)
    assert line.startswith("k3train: error: train.seq_len=128: media 1") and "258 tokens" in line


def test_clip_longer_than_the_temporal_table(prepared, tmp_path, capsys):
    line = one_error(capsys, check_args(prepared, tmp_path / "run", "--train.seq_len=320", "--vision.enabled=true",
                                        "--vision.pos_emb_time=1"), tmp_path)
    assert line.startswith("k3train: error: vision.pos_emb_time=1: ") and "media 2 (document 2) is a clip of 2" in line


def test_multimodal_format_needs_a_placeholder(tmp_path, capsys):
    line = one_error(capsys, ["check", "--config", "configs/tiny.yaml", "--world-size", "1",
                              f"--train.out_dir={tmp_path / 'run'}", "--data.format=multimodal"], tmp_path)
    assert line.startswith("k3train: error: data.format: multimodal data needs data.media_placeholder_token")
