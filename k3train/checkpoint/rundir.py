"""The run directory: what a start would overwrite or be shadowed by, and moving it aside (never deleting it).

Why: a new run (``checkpoint.resume=none``) in a directory that holds another run would truncate its
``metrics.jsonl``, and the old run's newer checkpoints would shadow the new run's (pruned at once, loaded by the
next ``resume=auto``). Likewise ``resume=PATH`` from an older checkpoint of a directory that holds newer ones.
Such a start is refused (:func:`conflicts`, checked by ``resume_preflight``) unless ``checkpoint.overwrite=true``,
which moves the conflicting data into ``previous-N/`` (:func:`set_aside`, rank 0, at start).
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from k3train.config import Config

from .manager import COMPLETE, TMP_PREFIX, is_checkpoint_entry, read_info, remove_incomplete, step_of

log = logging.getLogger(__name__)

RUN_FILES = ("config.yaml", "metrics.jsonl", "wandb")


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.train.out_dir) / "checkpoints"


def run_data(cfg: Config) -> list[Path]:
    """Everything of a run already in ``train.out_dir`` and the checkpoint root."""
    out, root = Path(cfg.train.out_dir), checkpoint_root(cfg)
    found = [out / n for n in RUN_FILES if (out / n).exists()]
    if root.is_dir():
        found += sorted(p for p in root.iterdir() if is_checkpoint_entry(p.name))
    return found


def resume_step(path: Path) -> int:
    try:
        return int(read_info(path)["step"])
    except (OSError, ValueError, KeyError):
        s = step_of(path)
        return -1 if s is None else s


def conflicts(cfg: Config) -> list[Path]:
    """What this start would overwrite or be shadowed by (empty: nothing)."""
    mode, root = cfg.checkpoint.resume, checkpoint_root(cfg)
    if mode == "auto":  # continuing: only metrics of a run that left no checkpoint would be overwritten
        metrics = Path(cfg.train.out_dir) / "metrics.jsonl"
        if root.is_dir() and any(step_of(p) is not None and (p / COMPLETE).is_file() for p in root.iterdir()):
            return []
        return [metrics] if metrics.is_file() and metrics.stat().st_size else []
    if mode == "none":
        return run_data(cfg)
    if not root.is_dir():
        return []
    start = resume_step(Path(mode))
    return sorted((p for p in root.iterdir() if step_of(p) is not None and step_of(p) > start), key=step_of)


def describe(paths: list[Path]) -> str:
    names = [p.name for p in paths]
    steps = [p for p in paths if step_of(p) is not None]
    ckpts = f"{len(steps)} checkpoint dir(s) up to {max(steps, key=step_of).name}" if steps else ""
    rest = [n for n in names if step_of(Path(n)) is None and n != "latest" and not n.startswith(TMP_PREFIX)]
    return ", ".join([*rest, *([ckpts] if ckpts else [])]) or ", ".join(names)


def _next_previous(base: Path) -> Path:
    n = 1
    while (base / f"previous-{n}").exists():
        n += 1
    return base / f"previous-{n}"


def _move(items: list[Path], base: Path, dest: Path) -> None:
    for p in items:
        target = dest / p.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(p, target)


def _inside(p: Path, base: Path) -> bool:
    return p.resolve().is_relative_to(base.resolve())


def set_aside(cfg: Config) -> list[Path]:
    """Rank 0, with ``checkpoint.overwrite=true``: move the conflicting data into ``previous-N/`` directories
    (``<out_dir>/previous-N`` for a new run, ``<checkpoint root>/previous-N`` for newer checkpoints that a
    ``resume=PATH`` would be shadowed by, with a copy of ``metrics.jsonl``). Returns the directories made."""
    items = conflicts(cfg)
    if not items:
        return []
    out, root = Path(cfg.train.out_dir), checkpoint_root(cfg)
    made = []
    if cfg.checkpoint.resume == "none":
        under_out = [p for p in items if _inside(p, out)]
        elsewhere = [p for p in items if not _inside(p, out)]
        for group, base in ((under_out, out), (elsewhere, root)):
            if group:
                dest = _next_previous(base)
                _move([p.resolve() for p in group], base.resolve(), dest.resolve())
                made.append(dest)
    else:
        dest = _next_previous(root)
        _move([p.resolve() for p in items], root.resolve(), dest.resolve())
        if (out / "metrics.jsonl").is_file():
            shutil.copy2(out / "metrics.jsonl", dest / "metrics.jsonl")
        made.append(dest)
    for d in made:
        log.warning("checkpoint.overwrite: moved the previous run's data aside into %s", d)
    return made


def prepare_run_dir(cfg: Config) -> None:
    """Rank 0 at start: create the run directory, move conflicting data aside (overwrite=true; otherwise
    preflight has refused the start), remove incomplete checkpoint directories of a crashed save."""
    Path(cfg.train.out_dir).mkdir(parents=True, exist_ok=True)
    if cfg.checkpoint.overwrite:
        set_aside(cfg)
    root = checkpoint_root(cfg)
    for stale in remove_incomplete(root):
        log.warning("removed the incomplete checkpoint directory %s (a save that never finished)", stale)
    if root.is_dir():
        for p in root.iterdir():
            if step_of(p) is not None and p.is_dir() and not (p / COMPLETE).is_file():
                log.warning("%s has no %s marker: it is never loaded", p, COMPLETE)
