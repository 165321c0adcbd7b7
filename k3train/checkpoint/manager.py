"""Atomic, verified ``torch.distributed.checkpoint`` (DCP) checkpoints, written synchronously or in the background.

Layout under the checkpoint root::

    step_00000010/            one complete checkpoint (DCP shards + .metadata)
        rank_00000.pt         per-rank state that is not a tensor shard (RNG states, data position, step): tensors
                              and plain values only, read with ``weights_only=True`` (k3train/checkpoint/safe_load.py)
        COMPLETE              JSON written last: step, world size, run fingerprint, LR schedule and the MANIFEST
                              (size + CRC-32 of every other file in the directory)
    damaged_step_00000008/    a checkpoint that failed verification at a start, moved out of the way (kept)
    latest                    text file naming the newest complete step directory (replaced atomically)

Why atomic: every rank writes into ``.tmp_step_XXXXXXXX``; only after all ranks finished does each rank fsync
and checksum the files it wrote, rank 0 gather the manifest, write ``COMPLETE`` and rename the directory into
place, then replace ``latest``. A crash at any point leaves the previous complete checkpoint untouched and
selectable; incomplete temporary directories are removed at the next start and the next save.

Why a manifest: a checkpoint can be damaged after it was completed (a truncated copy, a lost file, flipped
bytes). :meth:`select` verifies candidates (each rank checks a share of the files) and falls back to the newest
one that verifies. Pruning (``keep``) only ever deletes checkpoints OLDER than the one just written and verified
by this run, so it can neither delete what a resume depends on nor let an older run's checkpoints win.

Asynchronous saves (``async_save``): the save call copies the state to a CPU staging copy (DCP's default stager),
writes the small per-rank file, and returns; DCP writes the shards in a background thread, over a process group
of its own (gloo) so that its collectives never interleave with the training loop's, and a second thread fsyncs
and checksums this rank's files once they are written. :meth:`poll` (every step,
collective) finishes the checkpoint -- manifest, ``COMPLETE``, rename -- once every rank's write is done;
:meth:`wait` blocks for it (before the next save, at the end, on exit).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from k3train.runtime.fault_injection import pause_point
from parallel.dims import new_group  # every process group gets the run's collective timeout

from .fsio import atomic_write_text as _atomic_write_text
from .fsio import check_file, file_record, fsync_dir, fsync_file
from .safe_load import (RANK_STATE_FORMAT, SafeFileSystemReader, UnsafeCheckpoint, check_plain, dcp_load,
                        load_rank_state)

log = logging.getLogger(__name__)


@contextmanager
def single_process_quiet():
    """``torch.distributed.checkpoint`` warns "torch.distributed is disabled, unavailable or uninitialized,
    assuming the intent is to save in a single process" on every save/load without a process group: that is
    exactly what a one-process run means, so the warning is dropped there (and only there)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield

COMPLETE = "COMPLETE"
TMP_PREFIX = ".tmp_step_"
DAMAGED_PREFIX = "damaged_"


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    if _dist_on():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str | Path) -> int | None:
    """The step of a ``step_XXXXXXXX`` directory name, None for any other name."""
    name = Path(path).name
    if not name.startswith("step_"):
        return None
    try:
        return int(name[len("step_"):])
    except ValueError:
        return None


def is_checkpoint_entry(name: str) -> bool:
    """Names a checkpoint root holds for a run: step dirs (complete or not), temporaries, quarantined, ``latest``."""
    return name == "latest" or name.startswith(("step_", TMP_PREFIX, DAMAGED_PREFIX + "step_"))


def read_info(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / COMPLETE).read_text())


def verify(path: str | Path, checksum: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why the checkpoint at ``path`` is damaged, or None when it verifies. ``share=(i, n)`` checks every n-th
    file of the manifest starting at i (so n ranks together check all of it); ``checksum=False`` checks only
    existence and sizes. A checkpoint written before manifests existed verifies by its marker alone."""
    path = Path(path)
    try:
        info = read_info(path)
    except (OSError, ValueError) as e:
        return f"unreadable {COMPLETE} marker ({e})"
    files = info.get("files")
    if files is None:
        return None
    names = sorted(files)
    for name in names[share[0]::share[1]]:
        why = check_file(path / name, files[name], checksum=checksum)
        if why:
            return why
    return None


def remove_incomplete(root: Path) -> list[Path]:
    """Delete the ``.tmp_step_*`` directories (saves that never completed) under ``root``; returns them. Rank 0
    only, and never while a save of this run is pending."""
    if not Path(root).is_dir():
        return []
    stale = [p for p in Path(root).iterdir() if p.name.startswith(TMP_PREFIX)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


@dataclass
class _Pending:
    step: int
    tmp: Path
    meta: dict[str, Any]
    future: Any  # Future of this rank's manifest part: DCP's background write, then fsync + checksums
    t0: float


class CheckpointManager:
    """Saves, verifies and finds checkpoints under ``root``. Construction (with torch.distributed initialised)
    and every method that writes or verifies are collective: all ranks call them in the same order."""

    def __init__(self, root: str | Path, keep: int = 2, async_save: bool = False) -> None:
        self.root = Path(root)
        self.keep = keep
        self.async_save = async_save
        # small control collectives (manifest gather, verification votes) on gloo whatever the training backend
        self._pg = new_group(None, "checkpoint", backend="gloo") if _dist_on() else None
        # DCP's own collectives of a background save run in another thread: they need a group of their own
        self._save_pg = new_group(None, "checkpoint_async", backend="gloo") if (async_save and _dist_on()) else None
        self._pending: _Pending | None = None
        self._bg: ThreadPoolExecutor | None = None  # fsyncs and checksums a background write's files
        self.last_stall_s = 0.0  # how long the last save() call blocked its caller

    # ---------------------------------------------------------------------------------------------------------
    # collectives
    def _gather(self, obj: Any) -> list[Any]:
        if self._pg is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self._pg)
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    def _all_true(self, flag: bool) -> bool:
        if self._pg is None:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._pg)
        return bool(t.item())

    def _agree(self, err: BaseException | None) -> None:
        """Raise on every rank when any rank failed (its own exception where it has one), so that no rank walks
        on into a collective the failed one never joins."""
        errs = self._gather(None if err is None else f"{type(err).__name__}: {err}")
        if err is not None:
            raise err
        bad = [(r, e) for r, e in enumerate(errs) if e]
        if bad:
            raise RuntimeError(f"checkpoint: rank {bad[0][0]} failed: {bad[0][1]}")

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        rank, _ = _rank_world()
        out, err = None, None
        if rank == 0:
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree
                err = e
        self._agree(err)
        return out

    # ---------------------------------------------------------------------------------------------------------
    def complete_checkpoints(self) -> list[Path]:
        """Step directories holding a ``COMPLETE`` marker, oldest first (not yet verified: see :meth:`select`)."""
        if not self.root.is_dir():
            return []
        out = [p for p in self.root.iterdir()
               if p.is_dir() and step_of(p) is not None and (p / COMPLETE).is_file()]
        return sorted(out, key=step_of)

    def latest(self) -> Path | None:
        """Newest COMPLETE checkpoint (the ``latest`` pointer is a hint; completeness is what counts)."""
        done = self.complete_checkpoints()
        return done[-1] if done else None

    read_info = staticmethod(read_info)


    # ---------------------------------------------------------------------------------------------------------
    def save(self, step: int, tensor_state: dict[str, Any], rank_state: dict[str, Any],
             meta: dict[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` (collective). Synchronous: returns once it is complete. With ``async_save``:
        returns after the staging copy; the checkpoint completes in :meth:`poll` / :meth:`wait`."""
        self.wait()
        t0 = time.perf_counter()
        tmp = self.root / f"{TMP_PREFIX}{step:08d}"

        def begin() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_incomplete(self.root)
            tmp.mkdir(parents=True)

        self._on_rank0(begin)
        rank, _ = _rank_world()
        err = None
        try:
            rank_state = {"format": RANK_STATE_FORMAT, **rank_state}
            check_plain(rank_state)  # what weights_only=True reads back: refused here, not at the resume
            part = tmp / f"rank_{rank:05d}.pt.part"
            torch.save(rank_state, part)
            os.replace(part, tmp / f"rank_{rank:05d}.pt")
        except Exception as e:  # noqa: BLE001
            err = e
        self._agree(err)
        if self.async_save:
            written = dcp.async_save(tensor_state, checkpoint_id=str(tmp), process_group=self._save_pg)

            def files_done() -> dict[str, dict[str, int]]:
                written.result()
                return self._hash_own(tmp, rank)

            self._bg = self._bg or ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3train-ckpt")
            self._pending = _Pending(step, tmp, dict(meta or {}), self._bg.submit(files_done), t0)
            self.last_stall_s = time.perf_counter() - t0
            log.info("checkpoint step %d: staged in %.2fs, writing in the background", step, self.last_stall_s)
            return self.root / step_dir_name(step)
        with single_process_quiet():
            dcp.save(tensor_state, checkpoint_id=str(tmp))
        final = self._finish(step, tmp, dict(meta or {}))
        self.last_stall_s = time.perf_counter() - t0
        log.info("checkpoint step %d saved to %s in %.2fs", step, final, self.last_stall_s)
        return final

    @property
    def pending_step(self) -> int | None:
        return None if self._pending is None else self._pending.step

    def poll(self) -> None:
        """Collective, cheap: complete the background checkpoint when every rank's write has finished."""
        if self._pending is not None and self._all_true(self._pending.future.done()):
            self.wait()

    def wait(self) -> Path | None:
        """Collective: block until the background checkpoint (if any) is written, then complete it."""
        p, self._pending = self._pending, None
        if p is None:
            return None
        own, err = None, None
        try:
            own = p.future.result()
        except Exception as e:  # noqa: BLE001
            err = e
        self._agree(err)
        final = self._finish(p.step, p.tmp, p.meta, own)
        log.info("checkpoint step %d saved to %s (%.2fs after the save started)", p.step, final,
                 time.perf_counter() - p.t0)
        return final

    def close(self) -> None:
        self.wait()
        if self._bg is not None:
            self._bg.shutdown(wait=True)
            self._bg = None

    def _own_files(self, tmp: Path, rank: int) -> list[Path]:
        """The files this rank wrote: its rank file and its DCP shards (DCP names them ``__<rank>_<i>.distcp``)."""
        return [tmp / f"rank_{rank:05d}.pt", *sorted(tmp.glob(f"__{rank}_*.distcp"))]

    def _hash_own(self, tmp: Path, rank: int) -> dict[str, dict[str, int]]:
        own = {}
        for f in self._own_files(tmp, rank):
            fsync_file(f)
            own[f.name] = file_record(f)
        return own

    def _finish(self, step: int, tmp: Path, meta: dict[str, Any],
                own: dict[str, dict[str, int]] | None = None) -> Path:
        """Collective: gather the manifest (``own``: this rank's part, computed here when None), then rank 0
        marks the directory complete and renames it into place."""
        rank, world = _rank_world()
        pause_point("checkpoint_before_complete", step)  # test-only fault-injection hook (k3train/runtime/fault_injection.py)
        err = None
        try:
            own = self._hash_own(tmp, rank) if own is None else own
        except Exception as e:  # noqa: BLE001
            err = e
        self._agree(err)
        parts = self._gather(own)
        final = self.root / step_dir_name(step)

        def complete() -> None:
            files: dict[str, dict[str, int]] = {}
            for part in parts:
                files.update(part)
            for f in sorted(tmp.iterdir()):  # what no rank claimed: DCP's .metadata, anything else
                if f.is_file() and f.name not in files:
                    fsync_file(f)
                    files[f.name] = file_record(f)
            fsync_dir(tmp)
            info = {"step": step, "world_size": world, "time": time.time(), **meta, "files": files}
            _atomic_write_text(tmp / COMPLETE, json.dumps(info, indent=1))
            if final.exists():  # re-saving the same step of this run (e.g. final save right after an interval)
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
            _atomic_write_text(self.root / "latest", final.name + "\n")
            self._prune(step)

        self._on_rank0(complete)
        return final

    def _prune(self, newest: int) -> None:
        """Keep ``keep`` checkpoints counting the one just written at ``newest``: only older ones are deleted,
        never one newer than it (which this run did not write)."""
        if self.keep <= 0:
            return
        older = [p for p in self.complete_checkpoints() if step_of(p) < newest]
        for old in older[:max(0, len(older) - (self.keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)

    # ---------------------------------------------------------------------------------------------------------
    def select(self, candidates: list[Path]) -> tuple[Path | None, list[tuple[Path, str]]]:
        """Collective: the first of ``candidates`` (newest first) whose files all verify against its manifest,
        and the damaged ones skipped on the way, with the reason."""
        rank, world = _rank_world()
        damaged: list[tuple[Path, str]] = []
        for path in candidates:
            reasons = [r for r in self._gather(verify(path, share=(rank, world))) if r]
            if not reasons:
                return path, damaged
            damaged.append((path, reasons[0]))
        return None, damaged

    def quarantine(self, path: Path) -> Path:
        """Collective: move a damaged checkpoint out of the way (``damaged_step_X``), keeping its files."""
        dest = self.root / f"{DAMAGED_PREFIX}{path.name}"
        n = 1
        while dest.exists():
            n += 1
            dest = self.root / f"{DAMAGED_PREFIX}{path.name}.{n}"
        self._on_rank0(lambda: os.replace(path, dest))
        return dest

    def load(self, path: str | Path, tensor_state: dict[str, Any], key: str = "checkpoint.resume",
             rank_state: bool = True) -> dict[str, Any]:
        """Load DCP tensors in place into ``tensor_state``; return this rank's per-rank state (or rank 0's when
        the checkpoint was written by a different world size, with RNG states dropped; ``{}`` with
        ``rank_state=False``: only tensors are wanted, e.g. a frozen target's weights). Collective. Nothing is
        unpickled beyond tensors, plain values and DCP's metadata classes (k3train/checkpoint/safe_load.py): a
        file that would run code is refused on every rank with :class:`UnsafeCheckpoint` (``key: why``); the
        metadata and the per-rank file are checked before DCP reads any shard."""
        path = Path(path)
        if not (path / COMPLETE).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
        rank, world = _rank_world()
        info = read_info(path)
        own = path / f"rank_{rank:05d}.pt"
        same_world = info.get("world_size") == world and own.is_file()
        reader = SafeFileSystemReader(path)
        state, why, err = None, None, None
        try:
            reader.read_metadata()  # the restricted unpickler; DCP's own call below gets the same object
            state = load_rank_state(own if same_world else path / "rank_00000.pt") if rank_state else {}
        except UnsafeCheckpoint as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree
            err = e
        refusals = [w for w in self._gather(why) if w]
        if refusals:  # every rank refuses with the same line (rank 0 prints it)
            raise UnsafeCheckpoint(f"{key}: {refusals[0]}")
        self._agree(err)
        try:
            with single_process_quiet():
                dcp_load(tensor_state, path, reader)
        except UnsafeCheckpoint as e:  # a value DCP stored as bytes that weights_only refuses (every rank)
            raise UnsafeCheckpoint(f"{key}: {e}") from None
        if same_world or not rank_state:
            return state
        state.pop("rng", None)
        log.warning("checkpoint %s was written by world size %s (now %d): RNG states not restored",
                    path, info.get("world_size"), world)
        return state
