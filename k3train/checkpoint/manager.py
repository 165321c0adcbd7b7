"""Atomic ``torch.distributed.checkpoint`` (DCP) checkpoints.

Layout under the checkpoint root::

    step_00000010/            one complete checkpoint (DCP shards + .metadata)
        rank_00000.pt         per-rank state that is not a tensor shard (RNG states, data position, step)
        COMPLETE              JSON written last; a directory without it is never loaded
    latest                    text file naming the newest complete step directory (replaced atomically)

Why atomic: every rank writes into ``.tmp_step_XXXXXXXX``; only after all ranks finished (barrier) does rank 0
write ``COMPLETE`` and rename the directory into place, then replace ``latest``. A crash at any point leaves
the previous complete checkpoint untouched and selectable; stale temporary directories are removed on the next
save. Tensor state (model and optimizer) is saved by DCP, so each rank writes only what it owns (pipeline stage,
optimizer shard) and the checkpoint can be read back by a different layout as long as parameter names match.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Saves and finds checkpoints under ``root``. All methods that touch DCP are collective."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    # ------------------------------------------------------------------------------------------------------
    def complete_checkpoints(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        out = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / COMPLETE).is_file()]
        return sorted(out, key=lambda p: int(p.name.split("_")[1]))

    def latest(self) -> Path | None:
        """Newest COMPLETE checkpoint (the ``latest`` pointer is a hint; completeness is what counts)."""
        done = self.complete_checkpoints()
        return done[-1] if done else None

    # ------------------------------------------------------------------------------------------------------
    def save(self, step: int, tensor_state: dict[str, Any], rank_state: dict[str, Any],
             meta: dict[str, Any] | None = None) -> Path:
        rank, world = _rank_world()
        t0 = time.perf_counter()
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp_{step_dir_name(step)}"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp_step_*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(tensor_state, checkpoint_id=str(tmp))
        part = tmp / f"rank_{rank:05d}.pt.part"
        torch.save(rank_state, part)
        os.replace(part, tmp / f"rank_{rank:05d}.pt")
        _barrier()
        if rank == 0:
            info = {"step": step, "world_size": world, "time": time.time(), **(meta or {})}
            _atomic_write_text(tmp / COMPLETE, json.dumps(info, indent=1))
            if final.exists():  # re-saving the same step (e.g. final save right after an interval save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_write_text(self.root / "latest", final.name + "\n")
            self._prune()
        _barrier()
        log.info("checkpoint step %d saved to %s in %.2fs", step, final, time.perf_counter() - t0)
        return final

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for old in self.complete_checkpoints()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------------
    @staticmethod
    def read_info(path: Path) -> dict[str, Any]:
        return json.loads((Path(path) / COMPLETE).read_text())

    def load(self, path: str | Path, tensor_state: dict[str, Any]) -> dict[str, Any]:
        """Load DCP tensors in place into ``tensor_state``; return this rank's per-rank state (or rank 0's when
        the checkpoint was written by a different world size, with RNG states dropped)."""
        path = Path(path)
        if not (path / COMPLETE).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
        dcp.load(tensor_state, checkpoint_id=str(path))
        rank, world = _rank_world()
        info = self.read_info(path)
        own = path / f"rank_{rank:05d}.pt"
        if info.get("world_size") == world and own.is_file():
            return torch.load(own, weights_only=False)
        state = torch.load(path / "rank_00000.pt", weights_only=False)
        state.pop("rng", None)
        log.warning("checkpoint %s was written by world size %s (now %d): RNG states not restored",
                    path, info.get("world_size"), world)
        return state
