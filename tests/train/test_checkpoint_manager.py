"""Checkpoint atomicity and integrity: only COMPLETE directories whose files match their manifest are loaded; a
crash mid-save (synchronous or in the background) leaves the last good one; pruning never reaches newer ones."""
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


# ----------------------------------------------------------------------------------------------------------------
# manifest, verification, fallback, pruning, background saves
from k3train.checkpoint.manager import read_info, verify  # noqa: E402


def test_manifest_records_every_file_and_detects_damage(tmp_path):
    m = CheckpointManager(tmp_path, keep=3)
    p = m.save(1, _state(1.0), {"step": 1})
    files = read_info(p)["files"]
    on_disk = {f.name for f in p.iterdir() if f.name != "COMPLETE"}
    assert set(files) == on_disk and "rank_00000.pt" in files and ".metadata" in files
    assert all(files[n]["size"] == (p / n).stat().st_size for n in files)
    assert verify(p) is None
    shard = next(p.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the checksum sees it
    shard.write_bytes(bytes(data))
    assert verify(p, checksum=False) is None
    assert "checksum" in verify(p)
    shard.write_bytes(bytes(data[:-7]))
    assert "bytes" in verify(p, checksum=False)
    shard.unlink()
    assert "missing" in verify(p, checksum=False)


def test_select_falls_back_to_newest_good_and_quarantine_keeps_files(tmp_path):
    m = CheckpointManager(tmp_path, keep=0)
    for s in (1, 2, 3):
        m.save(s, _state(float(s)), {"step": s})
    (tmp_path / "step_00000003" / "rank_00000.pt").unlink()
    with open(next((tmp_path / "step_00000002").glob("*.distcp")), "r+b") as f:
        f.truncate(5)
    path, damaged = m.select(m.complete_checkpoints()[::-1])
    assert path.name == "step_00000001"
    assert [(p.name, "missing" in why or "bytes" in why) for p, why in damaged] == [
        ("step_00000003", True), ("step_00000002", True)]
    moved = m.quarantine(damaged[0][0])
    assert moved.name == "damaged_step_00000003" and (moved / "COMPLETE").is_file()
    assert [p.name for p in m.complete_checkpoints()] == ["step_00000001", "step_00000002"]


def test_prune_never_deletes_newer_than_the_one_just_written(tmp_path):
    """A checkpoint newer than this run's save (another lineage) is neither pruned nor counted; older ones are."""
    m = CheckpointManager(tmp_path, keep=2)
    for s in (1, 2, 9):
        CheckpointManager(tmp_path, keep=0).save(s, _state(float(s)), {"step": s})
    m.save(3, _state(3.0), {"step": 3})
    assert [p.name for p in m.complete_checkpoints()] == ["step_00000002", "step_00000003", "step_00000009"]


def test_async_save_completes_only_after_wait(tmp_path):
    """A background save is invisible (no COMPLETE, previous stays latest) until finished: a crash meanwhile
    resumes the previous one. The staged copy is taken at the call: later in-place updates do not leak in."""
    m = CheckpointManager(tmp_path, keep=3, async_save=True)
    m.save(1, _state(1.0), {"step": 1})
    m.wait()
    st = _state(2.0)
    m.save(2, st, {"step": 2})
    assert m.pending_step == 2
    assert m.latest().name == "step_00000001"
    st["model"]["w"].fill_(99.0)  # the training loop goes on mutating the live tensors
    final = m.wait()
    assert final.name == "step_00000002" and m.latest() == final and verify(final) is None
    target = _state(0.0)
    m.load(final, target)
    assert torch.equal(target["model"]["w"], torch.full((4, 3), 2.0))


def test_async_write_failure_keeps_previous_and_next_save_cleans_up(tmp_path, monkeypatch):
    """The background write fails: wait() raises, nothing is marked complete, the next save removes the debris."""
    import k3train.checkpoint.manager as mgr

    m = CheckpointManager(tmp_path, keep=3, async_save=True)
    m.save(1, _state(1.0), {"step": 1})
    m.wait()
    monkeypatch.setattr(mgr.dcp, "async_save", lambda *a, **k: _failed_future(OSError("disk full")))
    m.save(2, _state(2.0), {"step": 2})
    with pytest.raises(OSError, match="disk full"):
        m.wait()
    monkeypatch.undo()
    assert m.latest().name == "step_00000001" and (tmp_path / ".tmp_step_00000002").is_dir()
    m.save(3, _state(3.0), {"step": 3})
    m.close()
    assert not (tmp_path / ".tmp_step_00000002").exists()
    assert [p.name for p in m.complete_checkpoints()] == ["step_00000001", "step_00000003"]


def _failed_future(exc):
    from concurrent.futures import Future

    f = Future()
    f.set_exception(exc)
    return f
