"""Loading a checkpoint runs no code: the per-rank state through ``weights_only``, DCP's metadata through an
unpickler that admits only DCP's own metadata classes.

Why: a pickle can name any importable callable (``os.system``, ``builtins.exec``) and unpickling calls it, so a
checkpoint copied from elsewhere -- or one whose files were replaced and whose ``COMPLETE`` manifest was rewritten
to match (the CRC-32 proves integrity, not origin) -- could run code at resume. So:

* the per-rank file (``rank_XXXXX.pt``: step, data position, RNG states) holds only tensors and plain values
  (checked when it is written: :func:`check_plain`) and is read with ``torch.load(..., weights_only=True)``;
* DCP's ``.metadata`` (pickled by ``torch.distributed.checkpoint``) is read by :class:`_MetadataUnpickler`,
  whose ``find_class`` admits exactly the globals a DCP metadata file holds -- found by listing what a real
  k3train checkpoint's ``.metadata`` looks up: DCP's metadata dataclasses, ``_StorageInfo``, ``torch.Size``,
  torch dtypes, ``torch.serialization._get_layout`` and ``pathlib`` paths (the ``checkpoint_id``) -- each of
  which, called or instantiated with any arguments, only builds a value. Every other global refuses the file
  before anything is called; and every shard a metadata names must be a file in the checkpoint directory;
* non-tensor values DCP stores as bytes (``BytesStorageMetadata``) are read with ``weights_only=True`` first.

Checkpoints written before safe loading (their RNG states are numpy arrays and tuples) are read with
``weights_only=True`` and numpy's array reconstruction admitted (``numpy._core.multiarray._reconstruct``,
``numpy.ndarray``, ``numpy.dtype`` and its uint32 class: they build an array of plain numbers and nothing else), then converted; the
next checkpoint is written in the new form. A file refused is one :class:`UnsafeCheckpoint` line naming the
file and the global it would have called.
"""
from __future__ import annotations

import io
import logging
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from k3train.config import ConfigError

from .rng import plain_rng_state

log = logging.getLogger(__name__)

RANK_STATE_FORMAT = 2  # the per-rank file's "format" key: tensors and plain values only (1: pickled objects)
METADATA_FILE = ".metadata"  # the name torch.distributed.checkpoint gives the global metadata file

_REFUSED = ("refused: a k3train checkpoint holds only tensors, plain values and DCP's metadata, so this file was "
            "not written by k3train or was altered after it was written")


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file that loading would have to run code for (bad input: one line, exit 2)."""


# ---------------------------------------------------------------------------------------------------------------
# DCP metadata
_DCP_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
_ADMITTED: frozenset[tuple[str, str]] = frozenset(
    {("torch.distributed.checkpoint.metadata", n) for n in _DCP_METADATA_CLASSES}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
       ("torch", "Size"),
       ("torch.serialization", "_get_layout")}
    | {(mod, cls) for mod in ("pathlib", "pathlib._local")
       for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")})


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata``; any global outside the admitted set raises :class:`UnsafeCheckpoint` before
    it is imported or called. No ``persistent_load``: a persistent id is refused by ``pickle`` itself."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"{self._path} holds a pickled {module}.{name}, which DCP's metadata never "
                               f"holds and unpickling would call; {_REFUSED}")


def read_dcp_metadata(ckpt_dir: str | Path, name: str = METADATA_FILE) -> Metadata:
    """DCP's metadata of the checkpoint directory ``ckpt_dir``, unpickled with only DCP's classes admitted."""
    path = Path(ckpt_dir) / name
    with open(path, "rb") as f:
        try:
            md = _MetadataUnpickler(f, path).load()
        except UnsafeCheckpoint:
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError,
                KeyError) as e:
            raise UnsafeCheckpoint(f"{path} is not DCP metadata k3train can read ({type(e).__name__}: "
                                   f"{' '.join(str(e).split())}); refused") from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(md).__name__}, not DCP metadata; refused")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or rel in ("", ".", "..") or Path(rel).name != rel or "\\" in rel:
            raise UnsafeCheckpoint(f"{path} names a shard {rel!r} outside the checkpoint directory; refused")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with :meth:`read_metadata` going through :func:`read_dcp_metadata`. The metadata
    is read once (:meth:`read_metadata` may be called first by the caller, to refuse a hostile file with its own
    error before DCP starts; DCP's call then gets the same object)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if self._metadata is None or rank is not None:
            md = read_dcp_metadata(self.path, METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            if rank is not None:
                md.storage_meta.load_id = self.load_id
                return md
            self._metadata = md
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a value stored as bytes must pass ``weights_only=True`` first."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        pos = value.tell()
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(f"checkpoint value {read_item.dest_index.fqn} {_unsafe_global(e)}; "
                                   f"{_REFUSED}") from None
        value.seek(pos)
        super().load_bytes(read_item, value)


def dcp_load(state: dict[str, Any], ckpt_dir: str | Path, reader: SafeFileSystemReader | None = None) -> None:
    """``torch.distributed.checkpoint.load`` of ``ckpt_dir`` into ``state`` (in place) through the safe reader
    and planner (collective under torch.distributed, like ``dcp.load``)."""
    try:
        dcp.load(state, storage_reader=reader or SafeFileSystemReader(ckpt_dir), planner=SafeLoadPlanner())
    except CheckpointException as e:  # DCP gathers every rank's failures: all ranks refuse with the same line
        refused = [exc for _, (exc, _tb) in sorted(e.failures.items()) if isinstance(exc, UnsafeCheckpoint)]
        if refused:
            raise UnsafeCheckpoint(str(refused[0])) from None
        raise


# ---------------------------------------------------------------------------------------------------------------
# per-rank state
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)

# what torch.save wrote for the numpy RNG state of checkpoints before safe loading (numpy 2 and numpy 1 names)
try:  # numpy >= 2 (numpy.core is numpy._core's deprecated alias there)
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
except ImportError:  # numpy 1.26
    from numpy.core.multiarray import _reconstruct as _np_reconstruct
_OLD_NUMPY_GLOBALS: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), (_np_reconstruct, "numpy._core.multiarray._reconstruct"),
                                 (_np_reconstruct, "numpy.core.multiarray._reconstruct")]
_OLD_NUMPY_NAMES = frozenset({"numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType", "numpy._core.multiarray._reconstruct",
                              "numpy.core.multiarray._reconstruct"})


def check_plain(value: Any, where: str = "rank state") -> None:
    """Raise ``TypeError`` naming the key when ``value`` holds anything but tensors, plain scalars, strings and
    dicts (string keys) / lists / tuples of them: what ``weights_only=True`` reads back without unpickling."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}, not a string")
            check_plain(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__name__}: the per-rank checkpoint "
                        f"state holds only tensors and plain values (convert it, e.g. to a tensor or a list)")


def _unsafe_global(e: BaseException) -> str:
    """What torch's weights-only unpickler refused, in a few words (its message spans many lines)."""
    m = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"but got <class '([\w.]+)'>", str(e))
    if m:
        return f"holds a pickled {m.group(1)}, which unpickling would call"
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    why = next((ln for ln in lines if not ln.startswith(("Weights only load failed", "Please file", "Check the"))),
               type(e).__name__)
    return f"cannot be read without unpickling objects ({why[:200]})"


def _unsafe_names(path: Path) -> set[str] | None:
    """The globals of a ``torch.save`` zip file outside torch's weights-only allowlist (a static scan: nothing
    is called), or None when the file cannot be scanned (not a zip file)."""
    try:
        return set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # noqa: BLE001 - a legacy or garbled file: the caller refuses it as it is
        return None


def _load_pre_safe(path: Path) -> dict[str, Any]:
    """A per-rank file written before safe loading: numpy's array reconstruction admitted, nothing else."""
    with torch.serialization.safe_globals(_OLD_NUMPY_GLOBALS):
        state = torch.load(path, map_location="cpu", weights_only=True)
    rng = state.get("rng") if isinstance(state, dict) else None
    npy = rng.get("numpy") if isinstance(rng, dict) else None
    if rng is not None:
        if not isinstance(npy, tuple) or len(npy) != 5 or not isinstance(npy[1], np.ndarray) \
                or npy[1].dtype != np.uint32 or npy[1].shape != (624,):
            raise UnsafeCheckpoint(f"{path} (written before safe loading) holds a numpy value that is not an "
                                   f"RNG state; refused")
        state["rng"] = plain_rng_state(rng)
    check_plain(state)
    log.warning("%s was written before safe loading: read with only numpy's array reconstruction admitted; the "
                "next checkpoint is written in the new form", path)
    return state


def load_rank_state(path: str | Path) -> dict[str, Any]:
    """The per-rank state of ``path`` (``rank_XXXXX.pt``), read with ``weights_only=True``; without its
    ``format`` key. Raises :class:`UnsafeCheckpoint` for a file that would run code when unpickled."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        names = _unsafe_names(path)
        if not names or not names <= _OLD_NUMPY_NAMES:
            raise UnsafeCheckpoint(f"{path} {_unsafe_global(e)}; {_REFUSED}") from None
        try:
            state = _load_pre_safe(path)
        except pickle.UnpicklingError as e2:
            raise UnsafeCheckpoint(f"{path} {_unsafe_global(e2)}; {_REFUSED}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise UnsafeCheckpoint(f"{path} holds no k3train per-rank state (a dict with an integer 'step'); refused")
    fmt = state.pop("format", 1)
    if fmt not in (1, RANK_STATE_FORMAT):
        raise UnsafeCheckpoint(f"{path} has per-rank state format {fmt!r}; this k3train reads formats 1 and "
                               f"{RANK_STATE_FORMAT}")
    return state
