"""The ``k3train`` command (k3train/cli.py): bad input at ``k3train train`` is one line and exit 2 before any
process starts; subcommands dispatch to what exists."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3train.cli import main

ROOT = Path(__file__).resolve().parents[2]
K3TRAIN = [sys.executable, "-m", "k3train.cli"]  # what the console script `k3train` runs (k3train.cli:main)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    return subprocess.run([*K3TRAIN, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, key", [
    (["--nproc", "2", "--train.steps=0"], "train.steps"),  # a bad value
    (["--nproc", "3"], "train.global_batch_size"),  # a layout that does not fit the world size (8 % 6)
    (["--nproc", "2", "--model.eos_token_id=7"], "model.eos_token_id"),  # token id vs the shipped tokenizer
])
def test_train_bad_input_is_one_line_and_starts_nothing(tmp_path, args, key):
    out = tmp_path / "run"
    res = _run(["train", "--config", "configs/tiny.yaml", f"--train.out_dir={out}", *args])
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"k3train: error: {key}"), res.stderr
    assert "launching" not in res.stdout and not out.exists()  # torchrun never started, nothing written


def test_train_launcher_builds_the_torchrun_command():
    from k3train.cli import _launcher_parser, torchrun_command

    a, rest = _launcher_parser().parse_known_args(["--config", "c.yaml", "--nproc", "8", "--nnodes", "2",
                                                   "--node-rank", "1", "--rdzv-endpoint", "node0:29500",
                                                   "--parallel.pp=4"])
    cmd = torchrun_command(a, rest)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]  # the same interpreter, so the same venv
    assert cmd[3:] == ["--nproc_per_node=8", "--nnodes=2", "--node_rank=1", "--rdzv_endpoint=node0:29500",
                       "--rdzv_backend=c10d", "-m", "k3train.train", "--config", "c.yaml", "--parallel.pp=4"]
    a, rest = _launcher_parser().parse_known_args(["--config", "c.yaml", "--nproc", "2"])
    assert "--standalone" in torchrun_command(a, rest)


def test_unknown_command_and_missing_rendezvous(capsys):
    assert main(["trian"]) == 2
    assert capsys.readouterr().err.startswith("k3train: error: unknown command 'trian'")
    assert main(["train", "--config", "configs/tiny.yaml", "--nnodes", "2"]) == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err


def test_check_and_count_dispatch(capsys, tmp_path):
    assert main(["check", "--config", "configs/tiny.yaml", "--world-size", "2", "--parallel.pp=2",
                 f"--train.out_dir={tmp_path}"]) == 0
    assert "are valid" in capsys.readouterr().out
    assert main(["count", "--config", "configs/tiny.yaml"]) == 0
    assert "total" in capsys.readouterr().out


def test_meta_tools_read_no_tokenizer():
    """configs/k3.yaml keeps the published (Kimi-tokenizer) ids: the tools that read no tokenizer (count, memory,
    plan: for_training=False) accept it; a run or --check compares the ids with data.tokenizer and refuses."""
    from k3train.config import ConfigError
    from k3train.preflight import check_token_ids, validate_run
    from k3train.data.tokenizer import load_config_tokenizer

    cfg = validate_run("configs/k3.yaml", [], 1, for_training=False)
    assert cfg.model.eos_token_id == 163586
    with pytest.raises(ConfigError, match=r"model.bos_token_id=163584 but data.tokenizer .* id 0"):
        check_token_ids(cfg, load_config_tokenizer(cfg))


@pytest.mark.parametrize("argv, key", [
    (["train", "--config", "configs/tiny.yaml", "--train.steps=0"], "train.steps"),
    (["check", "--config", "configs/tiny.yaml", "--train.kda_kernel=fast"], "train.kda_kernel"),
    (["train", "--config", "configs/tiny.yaml", "--model.num_experts_per_token=0"], "model.num_experts_per_token"),
])
def test_bad_config_is_reported_before_torch_loads(argv, key):
    """The CLI finds a bad config with the config package alone: torch (seconds to import) is never loaded."""
    code = ("import sys; from k3train.cli import main; rc = main(sys.argv[1:]); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    res = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"k3train: error: {key}:") and res.stderr.count("\n") == 1, res.stderr
    assert res.stdout.strip() == "no torch"


def test_one_bad_input_line_for_every_entry_point(capsys, tmp_path, monkeypatch):
    """k3train/runtime/bad_input.py: the one parser and printer (one line, exit 2) and the bad-input types."""
    from k3train.data.corpus import DataError
    from k3train.reporting.plot import main as plot_main
    from k3train.runtime.bad_input import EXIT_BAD_INPUT, ConfigError, OneLineParser, is_bad_input, \
        report_bad_input
    from k3train.train import main as train_main
    from parallel.dims import ParallelConfigError

    assert report_bad_input("a\n  multi-line   message") == EXIT_BAD_INPUT == 2
    assert capsys.readouterr().err == "k3train: error: a multi-line message\n"
    ap = OneLineParser(prog="k3train demo")
    ap.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--n", "x"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "k3train: error: k3train demo: argument --n: invalid int value: 'x'\n"
    with pytest.raises(SystemExit) as e:  # python -m k3train.train: the bare message, as always
        train_main(["--world-size", "x"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "k3train: error: argument --world-size: invalid int value: 'x'\n"
    assert plot_main([str(tmp_path), "-o", str(tmp_path / "p.png")]) == 2  # no metrics.jsonl there
    assert capsys.readouterr().err == f"k3train: error: {tmp_path}: no metrics.jsonl (is it a run directory, " \
                                      "train.out_dir of a run?)\n"
    for bad in (ConfigError("x"), DataError("x"), ParallelConfigError("x")):
        assert is_bad_input(bad)
    assert not is_bad_input(ValueError("x")) and not is_bad_input(KeyboardInterrupt())
    monkeypatch.setenv("RANK", "1")  # a rank of a run: only global rank 0 prints; a launcher always does
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert report_bad_input("seen once", rank_of_run=True) == 2 and capsys.readouterr().err == ""
    assert report_bad_input("launcher") == 2 and capsys.readouterr().err == "k3train: error: launcher\n"
