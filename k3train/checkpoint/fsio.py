"""Durable file operations for checkpoints: fsync, atomic text writes, per-file checksums.

Why: a checkpoint marked ``COMPLETE`` must still be complete after a power loss, so every file and directory is
fsynced before the marker is written; and the marker's manifest (size + CRC-32 of every file) lets a later start
tell a damaged checkpoint (truncated, missing or flipped bytes) from a good one without trying to load it.
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path

_CHUNK = 8 << 20


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created/renamed files) durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see either the old or the new content, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_record(path: Path) -> dict[str, int]:
    """``{"size", "crc32"}`` of one file (read in chunks: checkpoint shards can be large)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"size": size, "crc32": crc}


def check_file(path: Path, rec: dict[str, int], checksum: bool = True) -> str | None:
    """Why ``path`` does not match its manifest record, or None when it does. ``checksum=False`` checks
    existence and size only (a stat: cheap enough for every rank's start-up checks)."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != rec["size"]:
        return f"{path.name} has {size} bytes, the manifest says {rec['size']}"
    if checksum:
        got = file_record(path)
        if got["crc32"] != rec["crc32"]:
            return f"{path.name} fails its checksum (crc32 {got['crc32']:08x}, manifest {rec['crc32']:08x})"
    return None
