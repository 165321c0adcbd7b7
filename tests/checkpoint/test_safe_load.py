"""Loading a checkpoint runs no code (k3train/checkpoint/safe_load.py): hostile per-rank files, DCP metadata and
DCP byte values carrying a pickle payload are refused with one line -- also when the ``COMPLETE`` manifest was
rewritten to match them -- and the payload never runs; the per-rank state still round-trips exactly; a
checkpoint written before safe loading is migrated through numpy's array reconstruction only."""
from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_helpers import run_distributed
from k3train.checkpoint import CheckpointManager
from k3train.checkpoint.fsio import file_record
from k3train.checkpoint.manager import COMPLETE, verify
from k3train.checkpoint.rng import get_rng_state, set_rng_state
from k3train.checkpoint.safe_load import _ADMITTED, UnsafeCheckpoint, load_rank_state, read_dcp_metadata
from k3train.config import ConfigError


class _SystemPayload:
    """Unpickling this calls ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _TouchPayload:
    """Unpickling this calls ``pathlib.Path.touch(MARKER)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((4, 3), v), "h": torch.arange(6, dtype=torch.int64).to(torch.bfloat16)},
            "optim": {"w.m": torch.full((4, 3), -v)}}


def _draws() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(2).tolist())


def _rewrite_manifest(ckpt: Path) -> None:
    """What an attacker who replaced files does: make the manifest match them again."""
    info = json.loads((ckpt / COMPLETE).read_text())
    info["files"] = {n: file_record(ckpt / n) for n in info["files"]}
    (ckpt / COMPLETE).write_text(json.dumps(info))
    assert verify(ckpt) is None  # the CRC now vouches for the hostile file: only the unpickler stands in the way


def _one_line_refusal(excinfo, *parts: str) -> None:
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, ConfigError)  # bad input: one `k3train: error:` line, exit 2 (k3train/train.py)
    assert "\n" not in msg and msg.startswith("checkpoint.resume: "), msg
    for p in parts:
        assert p in msg, msg


def test_rank_state_round_trips_exactly_and_reads_with_weights_only(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    _draws()  # python's and numpy's cached gaussians are part of the state
    m = CheckpointManager(tmp_path / "ck", keep=2)
    rank_state = {"step": 1, "data": {"consumed_samples": 8, "split": "train"}, "rng": get_rng_state()}
    p = m.save(1, _state(1.0), rank_state)
    after = _draws()
    raw = torch.load(p / "rank_00000.pt", weights_only=True)
    assert raw["format"] == 2
    target = _state(0.0)
    got = m.load(p, target)
    assert torch.equal(target["model"]["w"], torch.full((4, 3), 1.0))
    assert torch.equal(target["model"]["h"], torch.arange(6).to(torch.bfloat16))
    assert "format" not in got and got["step"] == 1 and got["data"] == {"consumed_samples": 8, "split": "train"}
    set_rng_state(got["rng"])
    assert _draws() == after
    with pytest.raises(TypeError, match=r"rank state.extra is a numpy.ndarray"):  # refused at the save
        m.save(2, _state(2.0), {"step": 2, "extra": np.zeros(3)})


def test_a_hostile_rank_file_is_refused_and_nothing_runs(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep=2)
    p = m.save(1, _state(1.0), {"step": 1, "data": {"consumed_samples": 8}})
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "data": {"consumed_samples": 8}, "rng": _SystemPayload(marker)}, p / "rank_00000.pt")
    _rewrite_manifest(p)
    target = _state(0.0)
    with pytest.raises(UnsafeCheckpoint) as ei:
        m.load(p, target)
    _one_line_refusal(ei, "rank_00000.pt holds a pickled posix.system", "refused")
    assert not marker.exists()
    assert torch.equal(target["model"]["w"], torch.zeros(4, 3))  # refused before DCP read a shard
    with open(p / "rank_00000.pt", "wb") as f:  # a bare pickle (not torch's zip format) is refused too
        pickle.dump({"step": 1, "x": _TouchPayload(marker)}, f)
    with pytest.raises(UnsafeCheckpoint, match="rank_00000.pt"):
        load_rank_state(p / "rank_00000.pt")
    assert not marker.exists()


def test_a_hostile_dcp_metadata_is_refused_and_nothing_runs(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep=2)
    p = m.save(1, _state(1.0), {"step": 1})
    with open(p / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, just written
    marker = tmp_path / "pwned"
    md.planner_data = {**md.planner_data, "evil": _TouchPayload(marker)}
    with open(p / ".metadata", "wb") as f:
        pickle.dump(md, f)
    _rewrite_manifest(p)
    with pytest.raises(UnsafeCheckpoint) as ei:
        m.load(p, _state(0.0))
    _one_line_refusal(ei, ".metadata holds a pickled pathlib.Path.touch", "refused")
    assert not marker.exists()

    md.planner_data.pop("evil")  # a shard outside the directory: DCP would read any file the metadata names
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    with open(p / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(UnsafeCheckpoint, match="outside the checkpoint directory"):
        read_dcp_metadata(p)


def test_the_metadata_unpickler_admits_what_real_dcp_metadata_needs(tmp_path):
    """Every global a real checkpoint's .metadata looks up (several dtypes, a scalar tensor, bytes values) is
    admitted and the result equals plain unpickling; nothing is admitted that the files do not use."""
    m = CheckpointManager(tmp_path / "ck", keep=2)
    state = {"model": {"a": torch.ones(3, dtype=torch.float64), "b": torch.ones(2, 2, dtype=torch.int32),
                       "s": torch.tensor(3.0)}, "extra": {"n": 7, "name": "x"}}
    p = m.save(1, state, {"step": 1})
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(p / ".metadata", "rb") as f:
        plain = Recording(f).load()
    dtypes = {(mod, n) for mod, n in seen if mod == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert seen - dtypes <= _ADMITTED and dtypes
    ours = read_dcp_metadata(p)
    assert ours.state_dict_metadata == plain.state_dict_metadata and ours.storage_data == plain.storage_data
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "extra": {"n": 0, "name": ""}}
    m.load(p, target)  # byte values go through weights_only=True first
    assert target["extra"] == {"n": 7, "name": "x"} and torch.equal(target["model"]["b"], state["model"]["b"])


def test_a_hostile_byte_value_is_refused_and_nothing_runs(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep=2)
    marker = tmp_path / "pwned"
    p = m.save(1, {"model": {"w": torch.ones(2)}, "evil": _SystemPayload(marker)}, {"step": 1})  # pickled, not run
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpoint) as ei:
        m.load(p, {"model": {"w": torch.zeros(2)}, "evil": 0})
    _one_line_refusal(ei, "checkpoint value evil holds a pickled posix.system")
    assert not marker.exists()


def _old_format_rank_file(path: Path, rng: dict) -> None:
    """A per-rank file as k3train wrote it before safe loading (random/numpy states as tuples and arrays)."""
    torch.save({"step": 1, "data": {"consumed_samples": 8}, "rng": rng}, path)


def test_a_checkpoint_from_before_safe_loading_resumes_exactly_and_a_disguised_one_is_refused(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep=2)
    p = m.save(1, _state(1.0), {"step": 1})
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    after = _draws()
    _old_format_rank_file(p / "rank_00000.pt", old)
    _rewrite_manifest(p)
    got = m.load(p, _state(0.0))
    set_rng_state(got["rng"])
    assert _draws() == after

    marker = tmp_path / "pwned"  # numpy admitted: an object array still cannot carry a payload
    evil = np.empty(1, dtype=object)
    evil[0] = _SystemPayload(marker)
    _old_format_rank_file(p / "rank_00000.pt", {**old, "numpy": ("MT19937", evil, 0, 0, 0.0)})
    with pytest.raises(UnsafeCheckpoint, match="rank_00000.pt"):
        m.load(p, _state(0.0))
    assert not marker.exists()


def _two_ranks_body(rank: int, world_size: int, root: str) -> None:
    """Rank 1's file alone is hostile: both ranks refuse with the same line (none walks on into DCP's load)."""
    import torch.distributed as dist

    m = CheckpointManager(Path(root) / "ck", keep=2)
    p = m.save(1, {"model": {f"w{rank}": torch.ones(2)}}, {"step": 1})
    marker = Path(root) / "pwned"
    if rank == 1:
        torch.save({"step": 1, "x": _SystemPayload(marker)}, p / "rank_00001.pt")
    dist.barrier()
    if rank == 0:
        _rewrite_manifest(p)
    dist.barrier()
    with pytest.raises(UnsafeCheckpoint) as ei:
        m.load(p, {"model": {f"w{rank}": torch.zeros(2)}})
    _one_line_refusal(ei, "rank_00001.pt holds a pickled posix.system")
    assert not marker.exists()
    m.close()


def test_every_rank_refuses_when_one_ranks_file_is_hostile(tmp_path):
    run_distributed(_two_ranks_body, 2, str(tmp_path), timeout=180)
