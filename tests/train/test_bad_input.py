"""Bad input through the real entry point: one ``k3train: error:`` line naming the problem, exit code 2, no
traceback, before any training step."""
from __future__ import annotations

import shutil
from pathlib import Path


from train_helpers import FAST, run_train


def _expect_error(res, *needles: str) -> str:
    assert res.returncode == 2, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    err = res.stderr.strip()
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr
    lines = [ln for ln in err.splitlines() if ln.startswith("k3train: error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    assert "step" not in res.stdout  # no training step ran
    return lines[0]


def _copy(prefix: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copy(str(prefix) + ext, dst / (prefix.name + ext))
    return dst / prefix.name


def test_missing_config(tmp_path):
    _expect_error(run_train(["--config", str(tmp_path / "nope.yaml")]), "config file not found", "nope.yaml")


def test_malformed_config(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: {hidden_size: 64\n")
    _expect_error(run_train(["--config", str(p)]), "malformed YAML", "bad.yaml")


def test_unknown_key_in_file_and_override(tmp_path):
    p = tmp_path / "k.yaml"
    p.write_text("train:\n  stepz: 3\n")
    _expect_error(run_train(["--config", str(p)]), "train.stepz", "k.yaml")
    _expect_error(run_train(["--config", "configs/tiny.yaml", "--optim.lrr=1"]), "optim.lrr")


def test_wrong_type(tmp_path):
    _expect_error(run_train(["--config", "configs/tiny.yaml", "--train.steps=ten"]), "train.steps", "expected int")


def test_world_size_mismatch(tmp_path, corpus_prefix):
    # 2 processes cannot hold pp=4; every rank exits with the one-line error before any process group exists
    res = run_train(["--config", "configs/tiny.yaml", f"--data.path={corpus_prefix}", *FAST, "--parallel.pp=4",
                     f"--train.out_dir={tmp_path}"], nproc=2)
    assert res.returncode != 0
    assert "k3train: error: parallel: world size 2 is not divisible by pp*cp = 4" in res.stderr
    assert "step " not in res.stdout


def test_sizes_that_do_not_divide(tmp_path):
    _expect_error(run_train(["--config", "configs/tiny.yaml", "--train.global_batch_size=6",
                             "--train.micro_batch_size=4"]), "train.global_batch_size")
    _expect_error(run_train(["--config", "configs/tiny.yaml", "--parallel.pp_layers=[3,3]"]), "parallel.pp_layers")


def test_missing_dataset(tmp_path):
    _expect_error(run_train(["--config", "configs/tiny.yaml", f"--data.path={tmp_path / 'none'}"]),
                  "dataset file not found", "none.idx")


def test_truncated_bin(tmp_path, corpus_prefix):
    prefix = _copy(corpus_prefix, tmp_path / "trunc")
    b = Path(str(prefix) + ".bin")
    b.write_bytes(b.read_bytes()[:-1000])
    _expect_error(run_train(["--config", "configs/tiny.yaml", f"--data.path={prefix}", *FAST]), ".bin")


def test_idx_not_matching_bin(tmp_path, corpus_prefix):
    prefix = _copy(corpus_prefix, tmp_path / "mismatch")
    i = Path(str(prefix) + ".idx")
    raw = bytearray(i.read_bytes())
    i.write_bytes(bytes(raw[: len(raw) - 16]))  # index cut short: counts no longer match its size
    _expect_error(run_train(["--config", "configs/tiny.yaml", f"--data.path={prefix}", *FAST]), ".idx")


def test_tokenizer_vocab_larger_than_model(tmp_path, corpus_prefix):
    _expect_error(run_train(["--config", "configs/tiny.yaml", f"--data.path={corpus_prefix}",
                             "--model.vocab_size=1000", *FAST]), "model.vocab_size")


def test_check_mode_validates_for_a_world_size(corpus_prefix):
    ok = run_train(["--check", "--world-size", "4", "--config", "configs/tiny.yaml", f"--data.path={corpus_prefix}",
                    *FAST, "--parallel.pp=2"])
    assert ok.returncode == 0 and "valid" in ok.stdout, ok.stderr
    _expect_error(run_train(["--check", "--world-size", "3", "--config", "configs/tiny.yaml",
                             f"--data.path={corpus_prefix}", *FAST, "--parallel.pp=2"]), "world size 3")


def test_resume_from_missing_checkpoint(tmp_path, corpus_prefix):
    _expect_error(run_train(["--config", "configs/tiny.yaml", f"--data.path={corpus_prefix}", *FAST,
                             f"--checkpoint.resume={tmp_path / 'step_00000007'}"]), "checkpoint.resume")
