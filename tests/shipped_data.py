"""The shipped corpora that ``make test`` builds into ``data_cache/``, seen through private views: a directory of
the session's own holding symlinks to the built files, so that what a run writes beside its data (Megatron's
sample-index cache, ``<prefix>.cache/``) lands in the view, never in the checkout. The view's directory is fixed
per session (``K3TRAIN_TEST_DATA_VIEWS``, set by conftest.py and inherited by spawned ranks), so every rank of a
test reads the same path."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILT = ROOT / "data_cache"
SUFFIXES = (".bin", ".idx", ".meta.json", ".media.bin", ".media.npy")


def shipped_view(name: str) -> Path | None:
    """The prefix of a private view of ``data_cache/<name>`` (``corpus_text_document``, ``mm``), or None when
    that corpus is not built."""
    if not (BUILT / f"{name}.bin").is_file():
        return None
    views = Path(os.environ["K3TRAIN_TEST_DATA_VIEWS"])
    views.mkdir(parents=True, exist_ok=True)
    for suffix in SUFFIXES:
        src = BUILT / f"{name}{suffix}"
        if src.is_file():
            try:
                (views / f"{name}{suffix}").symlink_to(src)
            except FileExistsError:  # another rank of the same test made it first
                pass
    return views / name
