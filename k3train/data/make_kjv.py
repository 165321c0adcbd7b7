"""Build the shipped KJV corpus (``assets/kjv.txt.gz``) from Debian's ``bible -f`` output.

``python -m k3train.data.make_kjv --from-bible-kjv RAW [--output k3train/data/assets/kjv.txt.gz]``; the full
recipe is in ``k3train/data/assets/README.md``.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from k3train.data.corpus import DEFAULT_CORPUS, DataError, write_text_corpus

# Abbreviations printed by ``bible -f`` (Bible Retrieval System) -> book titles, in canonical order.
KJV_BOOKS: dict[str, str] = {
    "Ge": "Genesis", "Exo": "Exodus", "Lev": "Leviticus", "Num": "Numbers", "Deu": "Deuteronomy",
    "Josh": "Joshua", "Jdgs": "Judges", "Ruth": "Ruth", "1Sm": "1 Samuel", "2Sm": "2 Samuel",
    "1Ki": "1 Kings", "2Ki": "2 Kings", "1Chr": "1 Chronicles", "2Chr": "2 Chronicles", "Ezra": "Ezra",
    "Neh": "Nehemiah", "Est": "Esther", "Job": "Job", "Psa": "Psalms", "Prv": "Proverbs",
    "Eccl": "Ecclesiastes", "SSol": "Song of Solomon", "Isa": "Isaiah", "Jer": "Jeremiah",
    "Lam": "Lamentations", "Eze": "Ezekiel", "Dan": "Daniel", "Hos": "Hosea", "Joel": "Joel", "Amos": "Amos",
    "Obad": "Obadiah", "Jonah": "Jonah", "Mic": "Micah", "Nahum": "Nahum", "Hab": "Habakkuk",
    "Zep": "Zephaniah", "Hag": "Haggai", "Zec": "Zechariah", "Mal": "Malachi",
    "Mat": "Matthew", "Mark": "Mark", "Luke": "Luke", "John": "John", "Acts": "Acts", "Rom": "Romans",
    "1Cor": "1 Corinthians", "2Cor": "2 Corinthians", "Gal": "Galatians", "Eph": "Ephesians",
    "Phi": "Philippians", "Col": "Colossians", "1Th": "1 Thessalonians", "2Th": "2 Thessalonians",
    "1Tim": "1 Timothy", "2Tim": "2 Timothy", "Titus": "Titus", "Phmn": "Philemon", "Heb": "Hebrews",
    "Jas": "James", "1Pet": "1 Peter", "2Pet": "2 Peter", "1Jn": "1 John", "2Jn": "2 John", "3Jn": "3 John",
    "Jude": "Jude", "Rev": "Revelation",
}
_VERSE_RE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.+)$")


def kjv_chapters_from_brs(raw: str) -> list[str]:
    """Turn ``bible -f gen1:1-rev22:21`` output (one ``Ge1:1 text`` verse per line) into one document per
    chapter: a ``"Genesis 1"`` heading, a blank line, then ``"<verse> <text>"`` lines."""
    chapters: list[tuple[str, int, list[str]]] = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        m = _VERSE_RE.match(line)
        if m is None or m.group(1) not in KJV_BOOKS:
            raise DataError(f"line {lineno}: not a 'BookC:V text' verse line: {line[:60]!r}")
        book, ch, verse, text = KJV_BOOKS[m.group(1)], int(m.group(2)), int(m.group(3)), m.group(4).strip()
        if not chapters or chapters[-1][:2] != (book, ch):
            chapters.append((book, ch, []))
        chapters[-1][2].append(f"{verse} {text}")
    return [f"{book} {ch}\n\n" + "\n".join(verses) for book, ch, verses in chapters]


def _main() -> None:
    ap = argparse.ArgumentParser(description="Build the shipped KJV corpus from Debian's `bible -f` output.")
    ap.add_argument("--from-bible-kjv", required=True, help="output of `bible -f gen1:1-rev22:21`")
    ap.add_argument("--output", default=str(DEFAULT_CORPUS))
    a = ap.parse_args()
    docs = kjv_chapters_from_brs(Path(a.from_bible_kjv).read_text(encoding="utf-8"))
    write_text_corpus(docs, a.output)
    print(f"wrote {len(docs)} documents to {a.output}")


if __name__ == "__main__":
    _main()
