"""A resume from a checkpoint carrying a pickle payload (in a per-rank file, or in DCP's .metadata) with its
``COMPLETE`` manifest rewritten to match: the real entry point refuses it with one ``k3train: error:`` line and
exit 2, and the payload never runs (k3train/checkpoint/safe_load.py)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from k3train.checkpoint.fsio import file_record
from train_helpers import FAST, assert_ok, run_train_forked


class _Payload:
    """Unpickling this calls ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _args(prefix, out, *extra):
    return ["--config", "configs/tiny.yaml", f"--data.path={prefix}", f"--train.out_dir={out}", *FAST, *extra]


@pytest.fixture(scope="module")
def one_step(corpus_prefix, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_step")
    assert_ok(run_train_forked(_args(corpus_prefix, out, "--train.steps=1", "--checkpoint.resume=none")))
    return out


def _poison_rank_file(ckpt: Path, marker: Path) -> None:
    state = torch.load(ckpt / "rank_00000.pt", weights_only=True)
    torch.save({**state, "rng": _Payload(marker)}, ckpt / "rank_00000.pt")


def _poison_metadata(ckpt: Path, marker: Path) -> None:
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own file, just written
    md.planner_data = {**md.planner_data, "evil": _Payload(marker)}
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize("poison,what", [(_poison_rank_file, "rank_00000.pt holds a pickled posix.system"),
                                         (_poison_metadata, ".metadata holds a pickled posix.system")])
def test_resume_refuses_a_payload_in_one_line_and_runs_nothing(corpus_prefix, one_step, tmp_path, poison, what):
    out = tmp_path / "run"
    shutil.copytree(one_step, out)
    ckpt = out / "checkpoints" / "step_00000001"
    marker = tmp_path / "pwned"
    poison(ckpt, marker)
    info = json.loads((ckpt / "COMPLETE").read_text())
    info["files"] = {n: file_record(ckpt / n) for n in info["files"]}  # the manifest vouches for it again
    (ckpt / "COMPLETE").write_text(json.dumps(info))
    res = run_train_forked(_args(corpus_prefix, out, "--train.steps=2"))  # resume=auto picks step 1
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("k3train: error:")]
    assert len(lines) == 1 and lines[0].startswith("k3train: error: checkpoint.resume: ") and what in lines[0], \
        res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not marker.exists()
    assert not (out / "checkpoints" / "step_00000002").exists()  # nothing trained
