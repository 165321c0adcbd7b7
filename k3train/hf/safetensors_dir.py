"""A Hugging Face checkpoint directory of safetensors shards: headers, checks, and block reads.

``model.safetensors.index.json`` (``weight_map``: tensor -> shard file) or a single ``model.safetensors``. Every
shard's header (8-byte little-endian length, then JSON: ``{name: {dtype, shape, data_offsets}}``) is parsed here
-- a few bytes per tensor, never the data -- so a checkpoint is checked in full (shard present, header readable,
the index's tensors in the shard it names, data within the file: a truncated shard is caught) before anything is
built. Data is read through ``safetensors.safe_open``: a whole tensor, or a block of it (``get_slice``: the rows
of the experts a rank owns), one shard open at a time.

Problems are :class:`k3train.config.ConfigError` -- one line naming the file and the tensor (bad input, exit 2).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from k3train.config import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HEADER_LIMIT = 100 * 2 ** 20  # safetensors' own limit on the JSON header
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2,
               "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
BYTE_DTYPES = ("U8", "I8", "F8_E8M0")  # packed E2M1 pairs / E8M0 scales, read as uint8


@dataclass(frozen=True)
class TensorInfo:
    key: str
    file: str  # shard file name (relative to the directory)
    dtype: str  # safetensors dtype code (F32, BF16, U8, ...)
    shape: tuple[int, ...]
    start: int  # byte offsets within the file's data section
    end: int


def read_header(path: Path, where: str) -> tuple[dict[str, Any], int]:
    """``(header JSON, data section start)`` of one shard; ConfigError for an unreadable or short file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"{where}: shard {path.name} is truncated ({path.stat().st_size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > HEADER_LIMIT:
                raise ConfigError(f"{where}: shard {path.name} is not a safetensors file (header of {n} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read shard {path}: {e.strerror or e}") from None
    if len(raw) < n:
        raise ConfigError(f"{where}: shard {path.name} is truncated ({8 + len(raw)} bytes, its header alone needs "
                          f"{8 + n})")
    try:
        header = json.loads(raw)
    except ValueError:
        raise ConfigError(f"{where}: shard {path.name} has an unreadable header (not safetensors JSON)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{where}: shard {path.name} has an unreadable header")
    return header, 8 + n


class HFCheckpointDir:
    """The shards of ``hf_dir``. ``tensors`` (every tensor's :class:`TensorInfo`, from the headers) is parsed and
    checked at construction; :meth:`read` reads data. ``where``: the config key named in errors."""

    def __init__(self, hf_dir: str | Path, where: str = "checkpoint.load_hf") -> None:
        self.dir = Path(hf_dir)
        self.where = where
        if not self.dir.is_dir():
            raise ConfigError(f"{where}: {self.dir} is not a directory")
        self.index_meta, weight_map = self._weight_map()
        self.tensors: dict[str, TensorInfo] = {}
        by_file: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            by_file.setdefault(fname, []).append(key)
        for fname in sorted(by_file):
            self._read_shard(fname, by_file[fname])
        self._open: dict[str, Any] = {}
        self.bytes_read = 0

    def _weight_map(self) -> tuple[dict[str, Any], dict[str, str]]:
        index = self.dir / INDEX
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                wm = data["weight_map"]
                assert isinstance(wm, dict) and all(isinstance(v, str) for v in wm.values())
            except (OSError, ValueError, KeyError, AssertionError):
                raise ConfigError(f"{self.where}: {index} is not a safetensors index (a JSON object with a "
                                  f"weight_map of tensor -> file)") from None
            return dict(data.get("metadata") or {}), wm
        single = self.dir / SINGLE
        if single.is_file():
            header, _ = read_header(single, self.where)
            return {}, {k: SINGLE for k in header if k != "__metadata__"}
        raise ConfigError(f"{self.where}: {self.dir} holds neither {INDEX} nor {SINGLE}")

    def _read_shard(self, fname: str, keys: list[str]) -> None:
        path = self.dir / fname
        if not path.is_file():
            raise ConfigError(f"{self.where}: shard {fname} (named by {INDEX} for {sorted(keys)[0]}) not found in "
                              f"{self.dir}")
        header, data_start = read_header(path, self.where)
        size = path.stat().st_size
        for key in sorted(keys):
            entry = header.get(key)
            if not isinstance(entry, dict):
                raise ConfigError(f"{self.where}: {INDEX} puts {key} in {fname}, which does not hold it")
            dtype, shape = entry.get("dtype"), tuple(int(x) for x in entry.get("shape", ()))
            start, end = (int(x) for x in entry.get("data_offsets", (0, -1)))
            numel = 1
            for s in shape:
                numel *= s
            if dtype not in DTYPE_BYTES or end - start != numel * DTYPE_BYTES[dtype]:
                raise ConfigError(f"{self.where}: {key} in {fname}: header says dtype {dtype} shape {list(shape)} "
                                  f"but {end - start} bytes")
            if data_start + end > size:
                raise ConfigError(f"{self.where}: shard {fname} is truncated: {size} bytes, but {key} ends at byte "
                                  f"{data_start + end}")
            self.tensors[key] = TensorInfo(key, fname, dtype, shape, start, end)

    # ------------------------------------------------------------------------------------------------------------
    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``key`` (or its block ``index``: one slice per leading dim) as stored, on the CPU."""
        info = self.tensors.get(key)
        if info is None:
            raise ConfigError(f"{self.where}: tensor {key} is not in the checkpoint")
        f = self._open.get(info.file)
        if f is None:
            self.close()  # one shard open at a time: reads are ordered by shard (k3train/hf/load.py)
            f = self._open[info.file] = safe_open(str(self.dir / info.file), framework="pt", device="cpu")
        t = f.get_tensor(key) if index is None else f.get_slice(key)[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._open.clear()

    def file_order(self, key: str) -> tuple[str, int]:
        """Sort key putting reads shard by shard, in file order."""
        info = self.tensors[key]
        return info.file, info.start
