"""``k3train plot`` draws real runs' ``metrics.jsonl`` (k3train/reporting/plot.py), and rank 0 prints a run summary at the end
of training (k3train/reporting/run_summary.py). Two real in-process runs of the tiny config (Muon and AdamW, 3 steps)."""
from __future__ import annotations

import json

import pytest

from k3train.cli import main as k3train
from k3train.config import load_config
from k3train.reporting.plot import layout_label, read_run
from k3train.train import run_training

RUN = ["--train.seq_len=32", "--train.global_batch_size=2", "--train.micro_batch_size=1", "--train.steps=3",
       "--data.split=100,0,0", "--logging.wandb=false", "--optim.warmup_steps=1", "--checkpoint.interval=0",
       "--logging.peak_flops=1e10"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, corpus_prefix):
    out = tmp_path_factory.mktemp("runs")
    for name in ("muon", "adamw"):
        cfg = load_config("configs/tiny.yaml", [*RUN, f"--data.path={corpus_prefix}", f"--optim.name={name}",
                                                f"--train.out_dir={out / name}"], world_size=1)
        assert run_training(cfg) == 0
    return out


def test_run_summary_is_printed_at_the_end(two_runs, capsys, corpus_prefix, tmp_path):
    cfg = load_config("configs/tiny.yaml", [*RUN, f"--data.path={corpus_prefix}", f"--train.out_dir={tmp_path}",
                                            "--train.steps=2"], world_size=1)
    assert run_training(cfg) == 0
    out = capsys.readouterr().out
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs]
    assert "run summary: steps 1..2 (2 steps, 0 skipped), 128 tokens, wall time" in out
    assert (f"loss: first {losses[0]:.4f} (step 1), last {losses[1]:.4f} (step 2), best {min(losses):.4f} "
            f"(step {1 + losses.index(min(losses))})") in out
    assert "of 10.0 GFLOP/s per rank (logging.peak_flops)" in out  # the MFU denominator and its source
    assert "peak memory per rank (GiB): r0=" in out
    assert f"last checkpoint: {tmp_path / 'checkpoints' / 'step_00000002'}" in out


def test_plot_two_runs(two_runs, tmp_path):
    png = tmp_path / "cmp.png"
    assert k3train(["plot", str(two_runs / "muon"), str(two_runs / "adamw"), "-o", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    records, cfg = read_run(two_runs / "adamw")
    assert [r["step"] for r in records] == [1, 2, 3]
    label = layout_label(two_runs / "adamw", cfg)
    assert label.startswith(f"{two_runs / 'adamw'}: pp1 vpp1 dp1 cp1 ep1 zero1 adamw"), label


def test_plot_bad_run_dir_is_one_line(tmp_path, capsys):
    assert k3train(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3train: error:") and "no metrics.jsonl" in err[0]
