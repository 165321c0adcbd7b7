"""Megatron indexed datasets: writing, validating and building the packed GPT datasets.

On disk a dataset is Megatron's pair ``PREFIX.bin`` (token ids back to back) / ``PREFIX.idx`` (header,
per-sequence lengths and byte offsets, document boundaries), written with
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``, one sequence per document, each document
terminated by EOS. ``PREFIX.meta.json`` (ours) records the tokenizer the data was made with.

Megatron's own reader trusts the files: a truncated ``.bin`` is memory-mapped happily and fails later with a
numpy "buffer is smaller than requested size" error inside a sample read (or silently returns short reads),
a truncated ``.idx`` fails with a bare ``AssertionError``/``ValueError``. :func:`validate_indexed_dataset`
checks the header, the ``.idx`` size against its counts, the offsets, the document boundaries and the
``.bin`` size against the index before anything is handed to Megatron, and raises :class:`DataError` with one
line naming the file.

:func:`build_gpt_datasets` builds ``GPTDataset`` splits with ``BlendedMegatronDatasetBuilder`` (shuffled,
seeded, packed into ``seq_len + 1``-token samples). Megatron caches the document/sample/shuffle indices as
``.npy`` files; we put them in ``<prefix dir>/<prefix name>.cache/<fingerprint of the .idx>/`` so a re-made
dataset never reuses stale indices. When ``torch.distributed`` is initialised Megatron builds on global rank 0
first and the other ranks load after a ``barrier()`` on the default group (works with gloo; no CUDA call on
the single-dataset path), so the build is COLLECTIVE over the world. Independent processes (separate runs,
tests) serialise on an ``fcntl`` file lock in the cache directory, so they never read half-written files.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import struct
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch.distributed as dist

from k3train.config import SPLIT_NAMES, ConfigError, parse_split
from k3train.data.corpus import DataError

logger = logging.getLogger(__name__)

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
# Megatron's DType codes (indexed_dataset.DType); 8 = uint16 is what a small vocabulary gets.
_DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                7: np.float32, 8: np.uint16}
_MAX_SCAN_BYTES = 2 << 30  # scan token ids for range errors only below this .bin size


@dataclass(frozen=True)
class IndexInfo:
    """What a validated ``.idx`` says. ``sequence_lengths[i]`` tokens in sequence i; documents are the
    sequence ranges ``document_indices[j]:document_indices[j+1]``."""

    prefix: str
    dtype: type
    sequence_lengths: np.ndarray
    document_indices: np.ndarray
    num_tokens: int
    fingerprint: str  # sha1 of the .idx bytes

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0] - 1)


@contextlib.contextmanager
def _mcore() -> Iterator[None]:
    """Import megatron.core lazily (it takes seconds) and without its 'Transformer Engine and Apex are not
    installed' warnings, which say nothing about the data pipeline."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # megatron's own import-time notices
        yield


mcore_quiet = _mcore  # the public name (other data modules import megatron through it)


def idx_path(prefix: str | Path) -> Path:
    return Path(str(prefix) + ".idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(str(prefix) + ".bin")


def meta_path(prefix: str | Path) -> Path:
    return Path(str(prefix) + ".meta.json")


# --------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------
def validate_indexed_dataset(prefix: str | Path, vocab_size: int | None = None) -> IndexInfo:
    """Check ``PREFIX.idx``/``PREFIX.bin`` for existence and mutual consistency; with ``vocab_size`` also
    check that every token id is in ``[0, vocab_size)`` (for ``.bin`` files up to 2 GiB).

    Raises :class:`DataError` (one line, naming the offending file) on any problem."""
    ip, bp = idx_path(prefix), bin_path(prefix)
    for p in (ip, bp):
        if not p.is_file():
            raise DataError(f"dataset file not found: {p} (build it with tools/prepare_data.py)")
    raw = ip.read_bytes()
    if len(raw) < _IDX_HEADER_BYTES:
        raise DataError(f"{ip}: truncated index ({len(raw)} bytes, shorter than the {_IDX_HEADER_BYTES}-byte header)")
    if raw[:9] != _IDX_MAGIC:
        raise DataError(f"{ip}: not a Megatron index file (bad magic {raw[:9]!r})")
    (version,) = struct.unpack_from("<Q", raw, 9)
    if version != 1:
        raise DataError(f"{ip}: unsupported index version {version}")
    (code,) = struct.unpack_from("<B", raw, 17)
    if code not in _DTYPE_CODES:
        raise DataError(f"{ip}: unknown token dtype code {code}")
    dtype = _DTYPE_CODES[code]
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    expected = _IDX_HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
    if len(raw) != expected:
        raise DataError(f"{ip}: index is {len(raw)} bytes but its header ({n_seq} sequences, {n_doc} document "
                        f"boundaries) needs {expected}: truncated or corrupt")
    off = _IDX_HEADER_BYTES
    lengths = np.frombuffer(raw, dtype=np.int32, count=n_seq, offset=off)
    pointers = np.frombuffer(raw, dtype=np.int64, count=n_seq, offset=off + 4 * n_seq)
    doc_idx = np.frombuffer(raw, dtype=np.int64, count=n_doc, offset=off + 12 * n_seq)
    if n_seq == 0 or n_doc < 2:
        raise DataError(f"{ip}: the dataset holds no documents")
    if (lengths < 0).any():
        raise DataError(f"{ip}: negative sequence length at sequence {int(np.argmax(lengths < 0))}")
    itemsize = np.dtype(dtype).itemsize
    expected_ptr = np.zeros(n_seq, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=expected_ptr[1:])
    if not np.array_equal(pointers, expected_ptr):
        bad = int(np.argmax(pointers != expected_ptr))
        raise DataError(f"{ip}: byte offset of sequence {bad} is {int(pointers[bad])}, expected "
                        f"{int(expected_ptr[bad])}: corrupt index")
    if doc_idx[0] != 0 or doc_idx[-1] != n_seq or (np.diff(doc_idx) < 0).any():
        raise DataError(f"{ip}: document boundaries must rise from 0 to the sequence count {n_seq}: corrupt index")
    n_tokens = int(lengths.astype(np.int64).sum())
    bin_bytes = bp.stat().st_size
    if bin_bytes != n_tokens * itemsize:
        raise DataError(f"{bp}: data file is {bin_bytes} bytes but {ip.name} describes {n_tokens} tokens of "
                        f"{np.dtype(dtype).name} = {n_tokens * itemsize} bytes: truncated, or the .idx belongs "
                        f"to another .bin")
    if vocab_size is not None and 0 < bin_bytes <= _MAX_SCAN_BYTES:
        data = np.memmap(bp, dtype=dtype, mode="r")
        hi, lo = int(data.max()), int(data.min())
        del data
        if lo < 0 or hi >= vocab_size:
            raise DataError(f"{bp}: token ids span [{lo}, {hi}] but the tokenizer has {vocab_size} ids: the data "
                            "was made with another tokenizer")
    return IndexInfo(str(prefix), dtype, lengths.copy(), doc_idx.copy(), n_tokens,
                     hashlib.sha1(raw, usedforsecurity=False).hexdigest())


_warned_unverified: set[str] = set()


def check_metadata(prefix: str | Path, tokenizer: Any) -> None:
    """Check ``PREFIX.meta.json`` names the tokenizer ``data.tokenizer`` is (sha256 of the tokenizer file, its
    vocabulary size, its EOS id; ``tools/prepare_data.py`` records them). A mismatch is a :class:`DataError`;
    a dataset with no recorded hash (no metadata, or made elsewhere) cannot be verified: one warning per
    process and dataset (preflight runs this first; the loader's later call stays quiet)."""
    mp = meta_path(prefix)
    meta: dict[str, Any] = {}
    if mp.is_file():
        try:
            meta = json.loads(mp.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{mp}: unreadable metadata ({str(e).splitlines()[0]})") from None
        if not isinstance(meta, dict):
            raise DataError(f"{mp}: unreadable metadata (not a JSON object)")
    for key, ours in (("tokenizer_sha256", tokenizer.sha256), ("eos_id", tokenizer.eos_id),
                      ("vocab_size", tokenizer.vocab_size)):
        if key in meta and ours and meta[key] != ours:
            raise DataError(f"data.tokenizer: {mp}: dataset was made with {key}={meta[key]!r} but data.tokenizer "
                            f"{tokenizer.path} has {ours!r}: re-run tools/prepare_data.py with this tokenizer")
    if "tokenizer_sha256" not in meta and str(mp) not in _warned_unverified:
        _warned_unverified.add(str(mp))
        why = "has no tokenizer_sha256" if mp.is_file() else "is missing"
        logger.warning("%s %s: cannot verify that data.tokenizer %s made this dataset", mp, why, tokenizer.path)


def check_split_sizes(info: IndexInfo, split: str, seq_len: int, names: Iterable[str]) -> None:
    """Each split in ``names`` must hold at least one ``seq_len + 1``-token sample (Megatron would fail on an
    empty split, or loop forever on a too-short one). :class:`DataError` naming ``data.split``."""
    ranges = dict(zip(SPLIT_NAMES, split_document_ranges(info.num_sequences, split)))
    for name in names:
        rng = ranges[name]
        if rng is None:
            raise DataError(f"data.split={split!r} gives the {name} split weight 0, but the run reads it")
        tokens = int(info.sequence_lengths[rng[0]:rng[1]].astype(np.int64).sum())
        if tokens < seq_len + 1:
            raise DataError(f"data.split={split!r}: the {name} split of {info.prefix} gets documents "
                            f"{rng[0]}:{rng[1]} ({rng[1] - rng[0]} of {info.num_sequences}) = {tokens} tokens, "
                            f"fewer than one sample of seq_len+1={seq_len + 1}; use a larger dataset or give the "
                            "split weight 0 (e.g. data.split='100,0,0')")


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------
def write_indexed_dataset(prefix: str | Path, documents: Iterable[list[int] | np.ndarray], eos_id: int,
                          vocab_size: int, meta: dict[str, Any] | None = None,
                          extra_files: tuple[str, str] | None = None) -> IndexInfo:
    """Write ``PREFIX.bin/.idx`` (+ ``PREFIX.meta.json``) with Megatron's ``IndexedDatasetBuilder``: one
    sequence per document, ``eos_id`` appended to every document. Files are written under temporary names
    and renamed at the end, so a reader never sees a half-written dataset. ``extra_files=(TMP, FINAL)``: a companion
    dataset written under prefix TMP while ``documents`` ran (e.g. the chat loss mask) is renamed to FINAL with them.
    Returns the validated index."""
    with _mcore():
        # lazy: megatron-core takes seconds to import; only where an indexed dataset is read or built
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(prefix.name + f".tmp{os.getpid()}")
    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(str(bin_path(tmp)), dtype=dtype)
    n_docs = n_tokens = 0
    try:
        for doc in documents:
            arr = np.empty(len(doc) + 1, dtype=dtype)
            arr[:-1] = doc
            arr[-1] = eos_id
            builder.add_document(arr, [arr.size])
            n_docs += 1
            n_tokens += arr.size
        builder.finalize(str(idx_path(tmp)))
        if n_docs == 0:
            raise DataError(f"no documents to write to {prefix}")
        info_meta = {"format": "megatron-indexed", "documents": n_docs, "tokens": n_tokens,
                     "eos_id": eos_id, "vocab_size": vocab_size, "dtype": np.dtype(dtype).name, **(meta or {})}
        meta_path(tmp).write_text(json.dumps(info_meta, indent=1) + "\n")
        if extra_files is not None:
            for fn in (bin_path, idx_path):
                os.replace(fn(extra_files[0]), fn(extra_files[1]))
        for fn in (bin_path, idx_path, meta_path):
            os.replace(fn(tmp), fn(prefix))
    finally:
        for fn in (bin_path, idx_path, meta_path):
            with contextlib.suppress(FileNotFoundError):
                fn(tmp).unlink()
    return validate_indexed_dataset(prefix, vocab_size)


def read_documents_back(prefix: str | Path) -> Iterator[np.ndarray]:
    """Yield each document's tokens (including its EOS) through Megatron's ``IndexedDataset``."""
    with _mcore():
        # lazy: megatron-core takes seconds to import; only where an indexed dataset is read or built
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    info = validate_indexed_dataset(prefix)
    ds = IndexedDataset(str(prefix))
    for j in range(info.num_documents):
        lo, hi = int(info.document_indices[j]), int(info.document_indices[j + 1])
        parts = [np.asarray(ds[i]) for i in range(lo, hi)]
        yield np.concatenate(parts) if parts else np.zeros(0, dtype=info.dtype)


# --------------------------------------------------------------------------------------------------------------
# GPTDataset
# --------------------------------------------------------------------------------------------------------------
def _megatron_tokenizer(tokenizer: Any) -> Any:
    """A ``MegatronTokenizerBase`` view of our tokenizer: GPTDataset only reads ``eod``, ``pad``,
    ``vocab_size``, ``special_tokens_dict`` and (for its cache key) ``unique_identifiers``."""
    with _mcore():
        # lazy: megatron-core takes seconds to import; only where an indexed dataset is read or built
        from megatron.core.tokenizers import MegatronTokenizerBase

    class _View(MegatronTokenizerBase):
        def __init__(self, tok: Any) -> None:
            super().__init__(tok.path, {})
            self._tok = tok
            self.eod = self.eos = tok.eos_id
            self.bos = tok.bos_id
            self.pad = tok.pad_id
            self.special_tokens_dict = {"bos_token": tok.bos_id, "eos_token": tok.eos_id, "pad_token": tok.pad_id}
            # The cached indices depend only on document lengths (covered by the cache directory's .idx
            # fingerprint), so the key holds no tokenizer hash: re-training it does not invalidate them.
            self.unique_identifiers = {"class": "k3train.TextTokenizer", "eod": tok.eos_id, "pad": tok.pad_id}

        @property
        def vocab_size(self) -> int:  # type: ignore[override]
            return self._tok.vocab_size

        def tokenize(self, text: str) -> list[int]:  # type: ignore[override]
            return self._tok.encode(text)

        def detokenize(self, ids: list[int]) -> str:  # type: ignore[override]
            return self._tok.decode(ids)

        def vocab(self) -> dict:  # type: ignore[override]
            return self._tok._tok.get_vocab()

        def apply_chat_template(self, *a: Any, **k: Any) -> Any:  # type: ignore[override]
            raise NotImplementedError("no chat template")

    return _View(tokenizer)


def ensure_helpers() -> None:
    """Import Megatron's compiled dataset helpers (``helpers_cpp``, used to build the sample index).

    megatron-core wheels ship it prebuilt; ``megatron.core.datasets.utils.compile_helpers`` runs ``make`` in
    the package directory, whose Makefile/pybind11 the wheel does not carry, so there is nothing to compile
    here and a missing module is reported clearly instead."""
    try:
        with _mcore():
            # lazy: megatron-core takes seconds to import; only where an indexed dataset is read or built
            from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as e:
        raise DataError(f"megatron.core.datasets.helpers_cpp is not importable ({e}); reinstall megatron-core "
                        "(its wheels ship the compiled helpers)") from None


def rows_over_epochs(epoch_rows: Callable[[int], list[Any]], num_samples: int | None) -> tuple[list[Any], int]:
    """``(rows, epochs)``: the packed rows of epochs 0, 1, ... (``epoch_rows(epoch)``, each epoch its own order)
    until there are ``num_samples`` (one epoch when None) -- the packing datasets' common loop."""
    rows: list[Any] = []
    epoch = 0
    while True:
        rows.extend(epoch_rows(epoch))
        epoch += 1
        if num_samples is None or len(rows) >= num_samples:
            return rows, epoch


def split_document_ranges(num_sequences: int, split: str) -> list[tuple[int, int] | None]:
    """Sequence ranges ``[beg, end)`` of the train/valid/test splits exactly as Megatron computes them from a
    split string such as ``"98,2,0"`` (None for a split of weight 0): weights normalised by their sum, book-ends
    by cumulative sums, ``round(bookend * num_sequences)`` -- Megatron's ``parse_and_normalize_split``,
    ``convert_split_vector_to_split_matrix`` and builder, in the same float operations (a test compares them),
    written out so that preflight does not import megatron (seconds) to check a split."""
    try:  # Megatron's parser picks numbers out with a regex and accepts anything; ours is strict
        weights = parse_split(split)
    except ConfigError as e:
        raise DataError(str(e)) from None
    total = weights[0] + weights[1] + weights[2]
    bounds = [0.0]
    for w in weights:
        bounds.append(bounds[-1] + w / total)
    return [None if hi <= lo else (int(round(lo * num_sequences)), int(round(hi * num_sequences)))
            for lo, hi in zip(bounds[:-1], bounds[1:])]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_gpt_datasets(prefix: str | Path, tokenizer: Any, seq_len: int, seed: int, split: str,
                       num_samples: dict[str, int | None]) -> dict[str, Any]:
    """Build Megatron ``GPTDataset`` splits of one indexed dataset.

    ``num_samples[name]`` (``name`` in train/valid/test) is the number of samples to draw for that split
    (None = one epoch). Only the splits named in ``num_samples`` are built (a split nobody reads is never
    built, so a too-small one cannot fail the run); splits of weight 0 in ``split`` are skipped. The
    document ranges always come from the full ``split`` string, so which splits are built never moves them.
    Returns ``{name: GPTDataset}``; each item ``ds[i]["tokens"]`` / ``["labels"]`` are the ``seq_len + 1`` sample
    tokens shifted by one.

    COLLECTIVE over the default process group when ``torch.distributed`` is initialised (Megatron's rank-0
    build + ``barrier``): call it on every rank, in the same order. Raises :class:`DataError` for bad files
    and for splits too small to yield one sample."""
    with _mcore():
        # lazy: megatron-core takes seconds to import; only where an indexed dataset is read or built
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

        # lazy: megatron-core takes seconds to import; only where an indexed dataset is read or built
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefix = Path(os.path.abspath(prefix))
    info = validate_indexed_dataset(prefix, tokenizer.vocab_size)
    check_metadata(prefix, tokenizer)
    ensure_helpers()
    if seq_len < 1:
        raise DataError(f"train.seq_len must be >= 1, got {seq_len}")

    ranges = split_document_ranges(info.num_sequences, split)
    wanted = [name for name, rng in zip(SPLIT_NAMES, ranges) if name in num_samples and rng is not None]
    check_split_sizes(info, split, seq_len, wanted)
    sizes: list[int | None] = [num_samples.get(name) for name in SPLIT_NAMES]
    for name, n in zip(SPLIT_NAMES, sizes):
        if name in wanted and n is not None and n < 1:
            raise DataError(f"{name} split: number of samples must be >= 1, got {n}")

    cache_dir = prefix.parent / f"{prefix.name}.cache" / info.fingerprint[:16]
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=([str(prefix)], None),
        split=split,
        path_to_cache=str(cache_dir),
        tokenizer=_megatron_tokenizer(tokenizer),
        reset_position_ids=False,  # positions run over the whole row; doc_ids isolate documents
        reset_attention_mask=False,
        eod_mask_loss=False,  # Batch.from_samples masks the EOS -> next-document prediction itself
        create_attention_mask=False,  # a [T, T] mask per sample is never used
        mmap_bin_files=True,
    )
    # drop the splits not asked for from the split matrix Megatron derived from the full split string
    config.split_matrix = [m if name in wanted else None for name, m in zip(SPLIT_NAMES, config.split_matrix)]
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    # Only processes that may write the cache take the lock: rank 0 of a job (the others load after
    # Megatron's barrier, so taking the lock there could deadlock against rank 0 waiting in the barrier),
    # or every process when torch.distributed is not initialised.
    writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    lock = _file_lock(cache_dir / ".lock") if writer else contextlib.nullcontext()
    with lock:
        datasets = builder.build()
    out = {name: ds for name, ds in zip(SPLIT_NAMES, datasets) if ds is not None}
    for name, n in zip(SPLIT_NAMES, sizes):
        if name in out and n is not None and len(out[name]) < n:
            raise DataError(f"{name} split of {prefix}: Megatron built {len(out[name])} samples, fewer than the "
                            f"{n} requested")
    return out


def sample_tokens(ds: Any, idx: int) -> np.ndarray:
    """The ``seq_len + 1`` packed tokens of sample ``idx`` of a GPTDataset (int64)."""
    item = ds[int(idx)]
    tokens, labels = item["tokens"], item["labels"]
    return np.concatenate([tokens.numpy(), labels.numpy()[-1:]]).astype(np.int64)
