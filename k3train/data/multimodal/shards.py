"""Megatron-Energon WebDataset shards of interleaved image/video + text samples: writing and reading (tarfile).

A dataset is a directory::

    DIR/.nv-meta/dataset.yaml   what Energon builds from it: a CrudeWebdataset (samples handed to a cooker as
                                dicts of raw members), subflavor ``k3train: interleaved-v1``
    DIR/.nv-meta/split.yaml     ``split_parts: {train: [...], val: [...], test: [...]}`` (shard paths) + ``exclude``
    DIR/.nv-meta/.info.yaml     ``shard_counts: {shard path: samples}``
    DIR/shards/shard_000.tar    WebDataset tar shards

A sample is the group of consecutive tar members sharing a key (the member name up to its first dot):

* ``<key>.json``: ``{"sequence": [...]}``, the sample in reading order; each element is a text string,
  ``{"image": n}`` or ``{"video": [n, n', ...]}`` (a clip: the frames in order, all of one size);
* ``<key>.<n>.png``: picture ``n`` of the sample (an image, or one frame of a clip).

Energon's ``energon prepare`` also writes ``index.sqlite`` / ``index.uuid`` (its random-access index) into
``.nv-meta``; k3train reads the shards sequentially and does not need them (run ``energon prepare DIR`` once to
load these shards with Energon itself). Every problem is a :class:`DataError` naming the shard and the member.
"""
from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3train.data.corpus import DataError

META_DIR = ".nv-meta"
SUBFLAVOR = "interleaved-v1"
DATASET_YAML = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset",
                "subflavors": {"k3train": SUBFLAVOR}}


@dataclass
class ShardSample:
    """One sample read from a shard: ``sequence`` as in the JSON, ``pictures[n]`` the bytes of ``<key>.<n>.png``."""

    key: str
    sequence: list[Any]
    pictures: dict[int, bytes] = field(default_factory=dict)
    source: str = ""  # "shard.tar:key", for messages


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------
def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: the shard bytes depend on the data only
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: Path, samples: list[tuple[str, list[Any], list[bytes]]]) -> int:
    """Write ``[(key, sequence, [png bytes of picture 0, 1, ...])]`` as one tar shard; returns the sample count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, sequence, pngs in samples:
            if not key or "." in key or "/" in key:
                raise DataError(f"{path}: bad sample key {key!r} (no dots or slashes)")
            _add_member(tar, f"{key}.json", json.dumps({"sequence": sequence}, sort_keys=True).encode())
            for n, png in enumerate(pngs):
                _add_member(tar, f"{key}.{n}.png", png)
    return len(samples)


def write_energon_meta(root: Path, counts: dict[str, int], splits: dict[str, list[str]] | None = None) -> None:
    """``.nv-meta/{dataset,split,.info}.yaml`` for the shards ``counts`` (paths relative to ``root``); all shards
    in the train split part unless ``splits`` says otherwise."""
    meta = root / META_DIR
    meta.mkdir(parents=True, exist_ok=True)
    splits = splits or {"train": list(counts), "val": [], "test": []}
    (meta / "dataset.yaml").write_text(yaml.safe_dump(DATASET_YAML, sort_keys=False))
    (meta / "split.yaml").write_text(yaml.safe_dump({"exclude": [], "split_parts": splits}, sort_keys=False))
    (meta / ".info.yaml").write_text(yaml.safe_dump({"shard_counts": counts}, sort_keys=False))


# --------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------
def _load_yaml(path: Path) -> Any:
    if not path.is_file():
        raise DataError(f"{path}: missing (an Energon dataset needs .nv-meta/dataset.yaml, split.yaml and .info.yaml)")
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise DataError(f"{path}: unreadable YAML ({str(e).splitlines()[0]})") from None


def shard_list(root: str | Path) -> list[tuple[Path, int]]:
    """The shards of an Energon dataset in reading order (split parts train, val, test, each as listed;
    ``exclude`` dropped) with their sample counts from ``.info.yaml``."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"multimodal input {root}: not a directory (expected an Energon WebDataset with .nv-meta/)")
    ds = _load_yaml(root / META_DIR / "dataset.yaml")
    if not isinstance(ds, dict) or ds.get("__class__") != "CrudeWebdataset" or \
            (ds.get("subflavors") or {}).get("k3train") != SUBFLAVOR:
        raise DataError(f"{root / META_DIR / 'dataset.yaml'}: not a k3train interleaved dataset (expected "
                        f"__class__: CrudeWebdataset, subflavors: {{k3train: {SUBFLAVOR}}})")
    split = _load_yaml(root / META_DIR / "split.yaml")
    info = _load_yaml(root / META_DIR / ".info.yaml")
    parts = (split or {}).get("split_parts") if isinstance(split, dict) else None
    counts = (info or {}).get("shard_counts") if isinstance(info, dict) else None
    if not isinstance(parts, dict) or not isinstance(counts, dict):
        raise DataError(f"{root / META_DIR}: split.yaml needs split_parts and .info.yaml needs shard_counts")
    exclude = {x for pat in (split or {}).get("exclude") or [] for x in expand_braces(str(pat))}
    out: list[tuple[Path, int]] = []
    for name in ("train", "val", "test"):
        for rel in (x for pat in parts.get(name) or [] for x in expand_braces(str(pat))):
            if rel in exclude or any(rel == str(p.relative_to(root)) for p, _ in out):
                continue
            if rel not in counts:
                raise DataError(f"{root / META_DIR / '.info.yaml'}: no sample count for shard {rel}")
            out.append((root / rel, int(counts[rel])))
    if not out:
        raise DataError(f"{root / META_DIR / 'split.yaml'}: no shards listed")
    return out


def expand_braces(pattern: str) -> list[str]:
    """Energon's shard patterns: each ``{000..123}`` numeric range expands (zero-padded to its width)."""
    m = re.search(r"\{(\d+)\.\.(\d+)\}", pattern)
    if m is None:
        return [pattern]
    lo, hi, width = int(m.group(1)), int(m.group(2)), len(m.group(1))
    return [x for i in range(lo, hi + 1)
            for x in expand_braces(pattern[:m.start()] + str(i).zfill(width) + pattern[m.end():])]


def _parse_json(data: bytes, where: str) -> list[Any]:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{where}.json: malformed JSON ({e})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("sequence"), list) or not obj["sequence"]:
        raise DataError(f"{where}.json: expected {{\"sequence\": [text | {{\"image\": n}} | {{\"video\": [n, ...]}}, "
                        "...]}} with at least one element")
    return obj["sequence"]


def read_shard(path: Path, expected: int | None = None) -> Iterator[ShardSample]:
    """The samples of one tar shard in order; ``expected`` (from ``.info.yaml``) is checked at the end."""
    if not path.is_file():
        raise DataError(f"shard not found: {path}")
    n = 0
    seen: set[str] = set()
    cur: ShardSample | None = None
    try:
        with tarfile.open(path, "r:*") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                base = m.name.rsplit("/", 1)[-1]
                key, _, ext = base.partition(".")
                if cur is None or key != cur.key:
                    if cur is not None:
                        yield _finish(cur)
                        n += 1
                    if key in seen:
                        raise DataError(f"{path}: members of sample {key!r} are not contiguous")
                    seen.add(key)
                    cur = ShardSample(key, [], source=f"{path}:{key}")
                data = tar.extractfile(m).read()  # type: ignore[union-attr]
                if ext == "json":
                    cur.sequence = _parse_json(data, f"{path}:{key}")
                elif ext.endswith(".png") and ext[:-4].isdigit():
                    cur.pictures[int(ext[:-4])] = data
                else:
                    raise DataError(f"{path}: member {m.name}: unknown part {ext!r} (expected .json or .<n>.png)")
            if cur is not None:
                yield _finish(cur)
                n += 1
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{path}: unreadable tar shard ({type(e).__name__}: {e})") from None
    if expected is not None and n != expected:
        raise DataError(f"{path}: {n} samples but .nv-meta/.info.yaml says {expected}")


def _finish(s: ShardSample) -> ShardSample:
    if not s.sequence:
        raise DataError(f"{s.source}: sample has no .json member")
    return s


def read_energon(root: str | Path) -> Iterator[ShardSample]:
    """Every sample of an Energon dataset directory, shards in :func:`shard_list` order."""
    for path, count in shard_list(root):
        yield from read_shard(path, count)
