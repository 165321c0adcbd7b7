"""Checkpoint atomicity: only COMPLETE directories are ever loaded; a crash mid-save leaves the last good one."""
from __future__ import annotations

import pytest
import torch

from k3train.checkpoint import CheckpointManager


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((4, 3), v)}, "optim": {"w.m": torch.full((4, 3), -v)}}


def test_save_load_round_trip(tmp_path):
    m = CheckpointManager(tmp_path, keep=2)
    m.save(1, _state(1.0), {"step": 1, "data": {"consumed_samples": 8}})
    target = _state(0.0)
    rank_state = m.load(m.latest(), target)
    assert torch.equal(target["model"]["w"], torch.full((4, 3), 1.0))
    assert torch.equal(target["optim"]["w.m"], torch.full((4, 3), -1.0))
    assert rank_state["data"]["consumed_samples"] == 8


def test_incomplete_and_stale_directories_are_ignored(tmp_path):
    m = CheckpointManager(tmp_path, keep=3)
    m.save(2, _state(2.0), {"step": 2})
    # a crash after DCP wrote shards but before COMPLETE: a renamed-looking dir without marker, and a tmp dir
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / "__0_0.distcp").write_bytes(b"garbage")
    (tmp_path / ".tmp_step_00000004").mkdir()
    assert m.latest().name == "step_00000002"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        m.load(tmp_path / "step_00000003", _state(0.0))
    m.save(5, _state(5.0), {"step": 5})  # the next save clears the stale tmp dir
    assert not (tmp_path / ".tmp_step_00000004").exists()
    assert m.latest().name == "step_00000005"


def test_crash_during_save_keeps_previous(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, keep=2)
    m.save(1, _state(1.0), {"step": 1})

    def boom(*a, **k):
        raise OSError("disk full")

    import k3train.checkpoint.manager as mgr

    monkeypatch.setattr(mgr, "_atomic_write_text", boom)  # dies after all shards are written, before the marker
    with pytest.raises(OSError):
        m.save(2, _state(2.0), {"step": 2})
    monkeypatch.undo()
    assert m.latest().name == "step_00000001"
    target = _state(0.0)
    m.load(m.latest(), target)
    assert torch.equal(target["model"]["w"], torch.full((4, 3), 1.0))


def test_keep_prunes_old(tmp_path):
    m = CheckpointManager(tmp_path, keep=2)
    for s in (1, 2, 3):
        m.save(s, _state(float(s)), {"step": s})
    assert [p.name for p in m.complete_checkpoints()] == ["step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
