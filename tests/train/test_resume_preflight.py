"""resume_preflight and the run directory rules, on real checkpoint directories (no training: fast).

The end-to-end behaviour (exit codes, losses) is in test_resume_safety.py; here every branch of the rules.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3train.checkpoint import CheckpointManager
from k3train.checkpoint.fingerprint import run_fingerprint, schedule_record
from k3train.checkpoint.resume import NothingToDo, resume_preflight
from k3train.checkpoint.rundir import conflicts, set_aside
from k3train.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def _cfg(out: Path, *extra: str):
    return load_config(ROOT / "configs" / "tiny.yaml", [
        f"--train.out_dir={out}", f"--data.tokenizer={ROOT / 'k3train/data/assets/tokenizer.json'}",
        "--train.steps=10", *extra], world_size=1)


def _save(cfg, step: int, root: Path | None = None) -> Path:
    m = CheckpointManager(root or Path(cfg.train.out_dir) / "checkpoints", keep=0)
    meta = {"fingerprint": run_fingerprint(cfg), "schedule": schedule_record(cfg)}
    return m.save(step, {"model": {"w": torch.ones(3)}}, {"step": step}, meta)


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_new_run_into_a_used_dir_is_refused_and_set_aside_moves_everything(tmp_path):
    out, ext = tmp_path / "run", tmp_path / "ckpts"  # checkpoints outside the run directory
    cfg = _cfg(out, f"--checkpoint.dir={ext}")
    _save(cfg, 2, ext)
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    new = _cfg(out, f"--checkpoint.dir={ext}", "--checkpoint.resume=none")
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl, 1 checkpoint dir\(s\) up to "
                                          r"step_00000002\)"):
        resume_preflight(new)
    before_out, before_ext = _tree(out), _tree(ext)
    over = _cfg(out, f"--checkpoint.dir={ext}", "--checkpoint.resume=none", "--checkpoint.overwrite=true")
    resume_preflight(over)  # allowed; nothing moved by a check
    assert _tree(out) == before_out
    made = set_aside(over)
    assert made == [out / "previous-1", ext / "previous-1"]
    assert _tree(out / "previous-1") == before_out and _tree(ext / "previous-1") == before_ext
    assert conflicts(over) == []


def test_resume_path_rules(tmp_path):
    cfg = _cfg(tmp_path / "run")
    _save(cfg, 2)
    _save(cfg, 4)
    ck = tmp_path / "run" / "checkpoints"
    with pytest.raises(ConfigError, match="step_00000009 does not exist"):
        resume_preflight(_cfg(tmp_path / "run", f"--checkpoint.resume={ck / 'step_00000009'}"))
    older = _cfg(tmp_path / "run", f"--checkpoint.resume={ck / 'step_00000002'}")
    with pytest.raises(ConfigError, match=r"older than checkpoints .*step_00000004.* would shadow"):
        resume_preflight(older)
    over = _cfg(tmp_path / "run", f"--checkpoint.resume={ck / 'step_00000002'}", "--checkpoint.overwrite=true")
    resume_preflight(over)
    set_aside(over)
    assert (ck / "previous-1" / "step_00000004" / "COMPLETE").is_file() and not (ck / "step_00000004").exists()
    resume_preflight(older)  # nothing newer left
    with pytest.raises(ConfigError, match="checkpoint.overwrite: true needs"):
        _cfg(tmp_path / "run", "--checkpoint.overwrite=true")


def test_fingerprint_schedule_and_nothing_to_do(tmp_path, caplog):
    out = tmp_path / "run"
    _save(_cfg(out), 10)
    with pytest.raises(NothingToDo, match="at step 10 >= train.steps=10"):
        resume_preflight(_cfg(out))
    with pytest.raises(ConfigError) as e:
        resume_preflight(_cfg(out, "--train.steps=20", "--model.num_hidden_layers=4", "--train.seq_len=64",
                              "--train.global_batch_size=16"))
    msg = str(e.value)
    assert "belongs to a different run" in msg and "model.num_hidden_layers 8 -> 4" in msg
    assert "train.seq_len 128 -> 64" in msg and "train.global_batch_size 8 -> 16" in msg
    # allowed: layout, logging, checkpoint.*; the schedule change is a warning with both LRs
    with caplog.at_level("WARNING"):
        resume_preflight(_cfg(out, "--train.steps=20", "--parallel.recompute=true", "--logging.log_interval=5",
                              "--checkpoint.keep=7"))
    assert "changed LR schedule (train.steps 10 -> 20)" in caplog.text
    with pytest.raises(NothingToDo, match="train.stop_at_step=10"):
        resume_preflight(_cfg(out, "--train.steps=20", "--train.stop_at_step=10"))


def test_auto_without_checkpoint_never_truncates_metrics(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    resume_preflight(_cfg(out))  # empty dir: a fresh start
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="metrics.jsonl but no checkpoint to continue from"):
        resume_preflight(_cfg(out))
