"""The planner's persistent memory cache: the fitted pieces (:func:`~.pieces.trace_piece`), the optimizer updates'
transients and whole estimates' per-stage peaks, kept in the k3train cache directory
(:func:`k3train.runtime.cache_dir.cache_dir`) so that a second plan of the same model -- at another world size,
on another device, with another budget -- traces nothing it traced before.

One file per config (``plan/memory-<digest>.json``): the digest and the file's ``config`` are the config with its
layout keys left out (the layouts' pieces differ only by the shapes in their keys), and its ``code`` is
:func:`code_version` -- a digest of every source file of the packages whose code a trace runs, and of the torch
version. A file whose code or config differs (another checkout, another model), that does not parse (truncated,
damaged), or an entry of the wrong form, is never used: the pieces are traced again and the file rewritten.
Estimates are kept per layout and world size, with the identity (names, sizes, modification times) of the
dataset files the estimate reads micro-batches from; predicted steps (on a published device: a calibration of this
host may change) per layout, world size, device and routing skew.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from k3train.config import Config
from k3train.runtime.cache_dir import cache_dir

FORMAT = 1
CODE_PACKAGES = ("k3train", "parallel", "moonep", "kcp")
# layout keys: what differs between the layouts of one plan (their pieces are keyed by their shapes)
LAYOUT_KEYS = {"parallel": ("pp", "vpp", "dp", "cp", "ep", "zero", "moonep", "recompute", "schedule", "overlap_ep",
                            "pp_layers"),
               "train": ("micro_batch_size",)}
_VERSION: list[str] = []


def code_version() -> str:
    """A digest of every ``.py`` file of :data:`CODE_PACKAGES` (names and contents) and the torch version: a change
    anywhere in the code a trace may run makes every stored piece stale (memoised per process)."""
    if not _VERSION:
        root = Path(__file__).resolve().parents[3]
        h = hashlib.sha256(torch.__version__.encode())
        for pkg in CODE_PACKAGES:
            for f in sorted((root / pkg).rglob("*.py")):
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
        _VERSION.append(h.hexdigest()[:32])
    return _VERSION[0]


def config_text(cfg: Config) -> str:
    """The config without its layout keys and derived fields, as canonical JSON (what a file is for)."""
    d = cfg.to_dict()
    d.pop("derived", None)
    for sec, keys in LAYOUT_KEYS.items():
        for k in keys:
            d[sec].pop(k, None)
    return json.dumps(d, sort_keys=True, default=str)


def data_identity(cfg: Config) -> list[list[Any]]:
    """``[[name, size, mtime_ns], ...]`` of the files of the run's dataset (``data.path`` + any suffix): an
    estimate of whole-chunk traces reads its micro-batches."""
    prefix = Path(cfg.data.path)
    parent = prefix.parent if str(prefix.parent) else Path(".")
    try:
        files = sorted(p for p in parent.iterdir() if p.name.startswith(prefix.name) and p.is_file())
    except OSError:
        return []
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


class PieceCache(dict):
    """The fitted pieces of one config (``EstimateCache.pieces``), backed by a :class:`MemoryStore`: a key is
    looked up in the stored entries (by its ``repr``) when this process has not traced it."""

    def __init__(self, stored: dict[str, Any]) -> None:
        super().__init__()
        self.stored = stored

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        k = repr(key)
        if k in self.stored:
            self[key] = self.stored[k]
            return True
        return False

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def entries(self) -> dict[str, Any]:
        return {**self.stored, **{repr(k): v for k, v in self.items()}}


class MemoryStore:
    """The persistent cache file of one config (module docstring): ``pieces`` and ``ns`` (the dicts an
    :class:`~.cache.EstimateCache` traces into), estimates by layout; :meth:`save` writes what this process
    added (merged with what another process wrote meanwhile)."""

    def __init__(self, cfg: Config, directory: Path | None = None) -> None:
        self.text = config_text(cfg)
        digest = hashlib.sha256(self.text.encode()).hexdigest()[:24]
        self.path = (directory or cache_dir() / "plan") / f"memory-{digest}.json"
        self.data_id = data_identity(cfg)
        loaded = self._read()
        self.pieces = PieceCache(loaded.get("pieces", {}))
        self.ns = PieceCache(loaded.get("ns", {}))
        self.estimates: dict[str, Any] = loaded.get("estimates", {})
        self.predictions: dict[str, Any] = loaded.get("predictions", {})
        self.ignored = loaded.get("ignored", "")  # why an existing file was not used ("" if none or used)

    def _read(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            d = json.loads(self.path.read_text())
            why = ("another format" if d.get("format") != FORMAT else "other code" if d.get("code") != code_version()
                   else "another config" if d.get("config") != self.text else "")
        except (OSError, ValueError, AttributeError) as e:
            return {"ignored": f"unreadable ({type(e).__name__})"}
        if why:
            return {"ignored": why}
        return {k: {n: v for n, v in d.get(k, {}).items() if _valid(k, v)} if isinstance(d.get(k), dict) else {}
                for k in ("pieces", "ns", "estimates", "predictions")}

    def estimate_key(self, layout: Any, world: int) -> str:
        return json.dumps([repr(layout), world, self.data_id])

    @staticmethod
    def prediction_key(layout: Any, world: int, device: dict[str, Any], skew: float) -> str:
        return json.dumps([repr(layout), world, device, skew], sort_keys=True, default=str)

    def save(self) -> None:
        """Write this config's file: what is on disk (if still valid) updated with this process's entries."""
        now = self._read()
        out = {"format": FORMAT, "code": code_version(), "config": self.text,
               "pieces": {**now.get("pieces", {}), **self.pieces.entries()},
               "ns": {**now.get("ns", {}), **self.ns.entries()},
               "estimates": {**now.get("estimates", {}), **self.estimates},
               "predictions": {**now.get("predictions", {}), **self.predictions}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(out, f)
        os.replace(tmp, self.path)


def _valid(kind: str, v: Any) -> bool:
    """Whether a stored entry has the form its kind takes (anything else is dropped and traced again)."""
    if kind == "ns":
        return isinstance(v, int) and v >= 0
    if kind == "predictions":
        return (isinstance(v, dict) and isinstance(v.get("detail"), dict)
                and all(isinstance(v.get(k), (int, float)) for k in ("step_s", "compute", "exposed_comm", "bubble",
                                                                     "optimizer", "host")))
    if kind == "estimates":
        return (isinstance(v, dict) and isinstance(v.get("peak"), int)
                and isinstance(v.get("stage_peaks"), list) and all(isinstance(x, int) for x in v["stage_peaks"]))
    if isinstance(v, int):  # a piece's local expert count
        return v >= 0
    return (isinstance(v, list) and 1 <= len(v) <= 2
            and all(isinstance(f, list) and len(f) == 3 and all(isinstance(c, list) and len(c) == 3 and all(
                isinstance(x, (int, float)) for x in c) for c in f) for f in v))
