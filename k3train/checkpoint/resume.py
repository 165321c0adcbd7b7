"""Resume checks that run before any process group or model exists (called at the end of ``preflight``).

Why here and not in the trainer: a refused start must cost one line and no model build, and a run with nothing
left to do must say so at once. Every rank runs these checks identically (they only read the file system): a
stat of each file against the manifest, not a checksum (reading a large checkpoint once per rank at every start
would be too slow); the trainer verifies checksums collectively, each rank a share of the files, and falls back.
Only a checkpoint that would END the start (nothing to do) is checksummed here, since no trainer runs after it.
"""
from __future__ import annotations

import logging
from pathlib import Path

from k3train.config import Config, ConfigError

from .fingerprint import fingerprint_diff, run_fingerprint, schedule_change
from .manager import COMPLETE, read_info, step_of, verify
from .rundir import checkpoint_root, conflicts, describe

log = logging.getLogger(__name__)


class NothingToDo(Exception):
    """The checkpoint to resume already reached the end of this invocation: ``train.py`` prints the message and
    exits 0 without building anything."""


def _stop_step(cfg: Config) -> int:
    t = cfg.train
    return min(t.steps, t.stop_at_step) if t.stop_at_step > 0 else t.steps


def _usable(path: Path, stop: int) -> str | None:
    """Why ``path`` cannot be resumed, by a stat of its files -- and by their checksums when it is at or past
    ``stop`` (the start would end here, before the trainer's collective verification)."""
    why = verify(path, checksum=False)
    if why is None and read_info(path).get("step", 0) >= stop:
        why = verify(path)
    return why


def resume_candidate(cfg: Config) -> Path | None:
    """The checkpoint this start resumes from (None: a fresh start). Raises :class:`ConfigError` for a
    ``checkpoint.resume`` path that is missing, incomplete or damaged."""
    mode, stop = cfg.checkpoint.resume, _stop_step(cfg)
    if mode == "none":
        return None
    if mode == "auto":
        root = checkpoint_root(cfg)
        if not root.is_dir():
            return None
        done = sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None
                       and (p / COMPLETE).is_file()), key=step_of, reverse=True)
        return next((p for p in done if _usable(p, stop) is None), None)
    path = Path(mode)
    if not path.is_dir():
        raise ConfigError(f"checkpoint.resume: {mode} does not exist")
    if not (path / COMPLETE).is_file():
        raise ConfigError(f"checkpoint.resume: {mode} is not a complete checkpoint directory (no {COMPLETE} marker)")
    why = _usable(path, stop)
    if why:
        raise ConfigError(f"checkpoint.resume: {mode} is damaged: {why}")
    return path


def resume_preflight(cfg: Config) -> None:
    """Refuse a start that would overwrite or be shadowed by another run's data, or that would continue a
    different run; raise :class:`NothingToDo` when the checkpoint is already at the end; warn (rank 0) when the
    LR schedule differs from the checkpoint's."""
    ck = cfg.checkpoint
    path = resume_candidate(cfg)
    clash = conflicts(cfg)
    if clash and not ck.overwrite:
        if ck.resume == "none":
            raise ConfigError(
                f"checkpoint.resume=none: train.out_dir {cfg.train.out_dir} already holds a run ({describe(clash)});"
                f" continue it with --checkpoint.resume=auto, move it aside with --checkpoint.overwrite=true, or"
                f" choose another --train.out_dir")
        if ck.resume == "auto":
            raise ConfigError(
                f"checkpoint.resume=auto: train.out_dir {cfg.train.out_dir} holds a run's metrics.jsonl but no "
                f"checkpoint to continue from; start over with --checkpoint.resume=none --checkpoint.overwrite=true"
                f" (moves it aside), or choose another --train.out_dir")
        raise ConfigError(
            f"checkpoint.resume: {ck.resume} is older than checkpoints in {checkpoint_root(cfg)} "
            f"({describe(clash)}) that would shadow this run; move them aside with --checkpoint.overwrite=true")
    if path is None:
        return
    info = read_info(path)
    step = int(info["step"])
    old_fp = info.get("fingerprint")
    if old_fp is not None:
        diff = fingerprint_diff(old_fp, run_fingerprint(cfg))
        if diff:
            raise ConfigError(f"checkpoint.resume: {path} belongs to a different run: {'; '.join(diff)} (start a new"
                              f" run with another --train.out_dir, or --checkpoint.resume=none"
                              f" --checkpoint.overwrite=true)")
    stop = _stop_step(cfg)
    if step >= stop:
        what = "train.steps" if stop == cfg.train.steps else "train.stop_at_step"
        raise NothingToDo(f"nothing to do: {path} is at step {step} >= {what}={stop}")
    if old_fp is None:
        log.warning("checkpoint %s has no run fingerprint (written by an older k3train): not checked", path)
    if "schedule" in info:
        note = schedule_change(info["schedule"], cfg, step)
        if note:
            log.warning("%s", note)
