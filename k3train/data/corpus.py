"""Raw-text corpora: reading documents from files, and building the shipped KJV corpus.

Input formats read by :func:`read_documents` (the format is chosen by the file name):

``*.jsonl`` / ``*.jsonl.gz``
    one JSON object per line; the document is the string under ``json_key`` (default ``"text"``).
    Blank lines are skipped.
``*.txt`` / ``*.txt.gz`` (any other name is read as plain text too)
    documents are separated by a line that consists of exactly :data:`DOC_SEPARATOR` (``<|endofdoc|>``);
    newlines next to the separator are dropped, everything else is kept verbatim. A file without any
    separator line is ONE document.

A document that is empty (or only whitespace) is an error naming the file and the document's first line;
``skip_empty=True`` drops such documents instead.

The shipped corpus ``k3train/data/assets/kjv.txt.gz`` was made by :mod:`k3train.data.make_kjv` from the
output of Debian's ``bible`` program (see ``k3train/data/assets/README.md``).
"""
from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DOC_SEPARATOR = "<|endofdoc|>"

# The default corpus shipped with the package (the King James Bible, one document per chapter).
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_CORPUS = ASSETS_DIR / "kjv.txt.gz"


class DataError(ValueError):
    """Bad data on disk or bad data input; the message is one line naming the file and the problem."""


@dataclass(frozen=True)
class Document:
    """One document and where it came from (``source`` = ``file:line`` of its first line)."""

    text: str
    source: str


def open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz"))


def read_documents(path: str | Path, json_key: str = "text", skip_empty: bool = False) -> Iterator[Document]:
    """Yield the documents of one input file (format: see the module docstring).

    Raises :class:`DataError` for a missing/unreadable file, malformed JSON, a missing or non-string
    ``json_key`` and (unless ``skip_empty``) empty documents.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"input file not found: {p}")
    try:
        if _is_jsonl(p):
            yield from _read_jsonl(p, json_key, skip_empty)
        else:
            yield from _read_txt(p, skip_empty)
    except (OSError, EOFError, UnicodeDecodeError) as e:  # gzip errors are OSError/EOFError
        raise DataError(f"cannot read {p}: {type(e).__name__}: {e}") from None


def _read_jsonl(p: Path, key: str, skip_empty: bool) -> Iterator[Document]:
    with open_text(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: malformed JSON ({e.msg})") from None
            if not isinstance(obj, dict) or key not in obj:
                raise DataError(f"{p}:{lineno}: no {key!r} field in the JSON object")
            text = obj[key]
            if not isinstance(text, str):
                raise DataError(f"{p}:{lineno}: field {key!r} is {type(text).__name__}, expected a string")
            if not text.strip():
                if skip_empty:
                    continue
                raise DataError(f"{p}:{lineno}: empty document (field {key!r} is blank)")
            yield Document(text, f"{p}:{lineno}")


def _read_txt(p: Path, skip_empty: bool) -> Iterator[Document]:
    def flush(lines: list[str], start: int) -> Iterator[Document]:
        text = "".join(lines).strip("\r\n")
        if not text.strip():
            if skip_empty:
                return
            raise DataError(f"{p}:{start}: empty document (nothing before the next {DOC_SEPARATOR!r} line"
                            " or the end of the file)")
        yield Document(text, f"{p}:{start}")

    with open_text(p) as f:
        lines: list[str] = []
        start = 1
        for lineno, line in enumerate(f, 1):
            if line.rstrip("\r\n") == DOC_SEPARATOR:
                yield from flush(lines, start)
                lines, start = [], lineno + 1
            else:
                lines.append(line)
        yield from flush(lines, start)


def write_text_corpus(docs: list[str], path: str | Path) -> None:
    """Write documents in the ``.txt``/``.txt.gz`` format read by :func:`read_documents`.

    ``.gz`` output uses mtime 0 so the file's bytes depend only on the documents."""
    for i, d in enumerate(docs):
        if any(line == DOC_SEPARATOR for line in d.splitlines()):
            raise DataError(f"document {i} contains a {DOC_SEPARATOR!r} line")
        if not d.strip():
            raise DataError(f"document {i} is empty")
    body = ("\n" + DOC_SEPARATOR + "\n").join(d.strip("\r\n") for d in docs) + "\n"
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.name.endswith(".gz"):
        with open(p, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                 compresslevel=9) as gz:
            gz.write(body.encode("utf-8"))
    else:
        p.write_text(body, encoding="utf-8")
