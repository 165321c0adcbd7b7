"""A start never loses or shadows data, and resume continues the same run: real runs of the entry point.

One reference run (8 steps, checkpoints every 2) is made once; each test works on a copy of its directory (with
step 8 removed, so there is something left to do) and compares per-step losses with it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from k3train.checkpoint.manager import read_info, verify
from train_helpers import FAST, assert_ok, assert_same_run, read_metrics, run_train_forked

STEPS = 8


def _args(prefix, out, *extra):
    return ["--config", "configs/tiny.yaml", f"--data.path={prefix}", f"--train.out_dir={out}",
            f"--train.steps={STEPS}", "--checkpoint.interval=2", "--checkpoint.keep=10", *FAST, *extra]


def _error_lines(res):
    return [ln for ln in res.stderr.splitlines() if ln.startswith("k3train: error:")]


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def reference(corpus_prefix, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert_ok(run_train_forked(_args(corpus_prefix, out, "--checkpoint.resume=none")))
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    return out


@pytest.fixture()
def at6(reference, tmp_path):
    """A copy of the reference run as if it had stopped after step 6 (checkpoints 2, 4, 6)."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(_ckpt(out, 8))
    (out / "checkpoints" / "latest").write_text("step_00000006\n")
    return out


def _same_losses(got, ref, exact=True):
    if not exact:  # another layout: equal up to fp32 summation order
        assert_same_run(got, ref)
        return
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(got, ref):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]


def test_new_run_refuses_a_used_dir_and_overwrite_moves_it_aside(corpus_prefix, at6):
    before = _snapshot(at6)
    res = run_train_forked(_args(corpus_prefix, at6, "--checkpoint.resume=none"))
    assert res.returncode == 2 and len(_error_lines(res)) == 1, res.stderr[-3000:]
    assert "already holds a run" in res.stderr and "--checkpoint.overwrite=true" in res.stderr
    assert _snapshot(at6) == before  # nothing truncated, pruned or rewritten (config.yaml included)

    assert_ok(run_train_forked(_args(corpus_prefix, at6, "--checkpoint.resume=none", "--checkpoint.overwrite=true",
                               "--train.stop_at_step=2")))
    moved = at6 / "previous-1"
    assert _snapshot(moved) == before  # every old file, byte for byte, under previous-1/
    assert [r["step"] for r in read_metrics(at6)] == [1, 2]
    assert [p.name for p in sorted((at6 / "checkpoints").glob("step_*"))] == ["step_00000002"]
    assert read_info(_ckpt(at6, 2))["time"] != read_info(moved / "checkpoints" / "step_00000002")["time"]


def test_damaged_checkpoints_fall_back_to_the_newest_good_one(corpus_prefix, reference, tmp_path):
    """The finished run's step 8 has a flipped byte (only its checksum shows it: not 'nothing to do'), step 6
    lost a rank file, step 4 has a truncated shard: the run resumes from step 2, with the same losses."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shard = next(_ckpt(out, 8).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x5A
    shard.write_bytes(bytes(data))
    (_ckpt(out, 6) / "rank_00000.pt").unlink()
    with open(next(_ckpt(out, 4).glob("*.distcp")), "r+b") as f:
        f.truncate(1000)
    (out / "checkpoints" / ".tmp_step_00000009").mkdir()  # a save that crashed before completing
    res = run_train_forked(_args(corpus_prefix, out))
    assert_ok(res)
    assert "step_00000008 is damaged (__0_0.distcp fails its checksum" in res.stderr
    assert "step_00000006 is damaged (rank_00000.pt is missing)" in res.stderr
    assert "step_00000004 is damaged (__0_0.distcp has 1000 bytes" in res.stderr
    assert "resuming from step_00000002" in res.stderr
    assert not (out / "checkpoints" / ".tmp_step_00000009").exists()
    for s in (4, 6, 8):  # kept, out of the way
        assert (out / "checkpoints" / f"damaged_step_{s:08d}" / "COMPLETE").is_file()
    _same_losses(read_metrics(out), read_metrics(reference))


def test_damaged_explicit_resume_path_is_one_line_exit_2(corpus_prefix, reference, tmp_path):
    """resume=PATH names one checkpoint: a checksum failure (found after start-up, by the ranks' shared
    verification) is refused in one line with exit 2 -- no fallback to another checkpoint, no traceback."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shard = next(_ckpt(out, 8).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x5A  # same size: only the checksum shows it
    shard.write_bytes(bytes(data))
    res = run_train_forked(_args(corpus_prefix, out, f"--checkpoint.resume={_ckpt(out, 8)}", "--train.steps=10"))
    assert res.returncode == 2, res.stderr[-3000:]
    lines = _error_lines(res)
    assert len(lines) == 1 and "checkpoint.resume:" in lines[0] and "step_00000008 is damaged" in lines[0], lines
    assert "Traceback" not in res.stderr
    assert _ckpt(out, 8).is_dir()  # an explicitly named checkpoint is left where it is


def test_a_different_run_is_refused_naming_the_keys(corpus_prefix, at6, tmp_path):
    other = tmp_path / "other_data" / "kjv_copy"
    other.parent.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(str(corpus_prefix) + ext, str(other) + ext)
    meta = Path(str(corpus_prefix) + ".meta.json")
    if meta.is_file():
        shutil.copy(meta, str(other) + ".meta.json")
    before = _snapshot(at6)
    args = _args(corpus_prefix, at6, "--model.hidden_size=96", "--train.seed=7", f"--data.path={other}")
    res = run_train_forked(args)
    assert res.returncode == 2 and len(_error_lines(res)) == 1, res.stderr[-3000:]
    line = _error_lines(res)[0]
    assert "belongs to a different run" in line
    assert "model.hidden_size 64 -> 96" in line and "train.seed 1234 -> 7" in line
    assert f"data.path {Path(corpus_prefix).resolve()} -> {other.resolve()}" in line
    assert _snapshot(at6) == before


def test_schedule_change_warns_and_finished_run_has_nothing_to_do(corpus_prefix, reference, tmp_path):
    out = tmp_path / "done"
    shutil.copytree(reference, out)
    before = _snapshot(out)
    res = run_train_forked(_args(corpus_prefix, out))  # step 8 of 8 exists: exit 0 at once, nothing built or written
    assert_ok(res)
    assert f"k3train: nothing to do: {_ckpt(out, 8)} is at step 8 >= train.steps=8" in res.stdout
    assert "layout:" not in res.stderr and "training steps" not in res.stderr and "loss" not in res.stdout
    assert _snapshot(out) == before
    res = run_train_forked(_args(corpus_prefix, out, "--train.steps=12", "--check"))
    assert_ok(res)
    assert "changed LR schedule (train.steps 8 -> 12)" in res.stderr
    assert "the LR at step 8 is" in res.stderr and "under the old schedule" in res.stderr


def test_async_save_on_two_ranks_in_a_new_layout_resumes_exactly(corpus_prefix, at6, reference):
    """Resume the single-process run on 2 ranks (pp=2: a layout change is accepted), saving every step in the
    background; then resume the async-written step 7 in one process (resume=PATH with newer step 8 beside it:
    overwrite moves step 8 aside). Every step matches the uninterrupted run."""
    ref = read_metrics(reference)
    assert_ok(run_train_forked(_args(corpus_prefix, at6, "--parallel.pp=2", "--checkpoint.interval=1",
                               "--checkpoint.async_save=true"), nproc=2))
    for s in (7, 8):
        info = read_info(_ckpt(at6, s))
        assert info["world_size"] == 2 and {"__0_0.distcp", "__1_0.distcp", "rank_00001.pt"} <= set(info["files"])
        assert verify(_ckpt(at6, s)) is None
    _same_losses(read_metrics(at6), ref, exact=False)

    step7 = _ckpt(at6, 7)
    res = run_train_forked(_args(corpus_prefix, at6, f"--checkpoint.resume={step7}"))
    assert res.returncode == 2 and "would shadow this run" in res.stderr
    assert_ok(run_train_forked(_args(corpus_prefix, at6, f"--checkpoint.resume={step7}",
                                     "--checkpoint.overwrite=true")))
    assert (at6 / "checkpoints" / "previous-1" / "step_00000008" / "COMPLETE").is_file()
    _same_losses(read_metrics(at6), ref, exact=False)
