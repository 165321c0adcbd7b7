"""What the test suite must leave as it found it: the checkout's run directories, its built corpora and the user's
cache. ``UserStateGuard(paths)`` lists every file and directory under the paths (size and modification time)
at the start of the session; ``changes()`` names what was added, removed or rewritten since."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def listing(root: Path) -> dict[str, tuple[str, int, int]]:
    """``{path: (kind, size, mtime_ns)}`` of ``root`` and everything under it (symlinks not followed)."""
    out: dict[str, tuple[str, int, int]] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            p = Path(dirpath) / name if name != "." else Path(dirpath)
            st = p.lstat()
            kind = "dir" if p.is_dir() and not p.is_symlink() else "file"
            # a directory's own mtime moves when an entry is added or removed: those show as entries themselves
            out[str(p)] = (kind, 0 if kind == "dir" else st.st_size, 0 if kind == "dir" else st.st_mtime_ns)
    return out


@dataclass
class UserStateGuard:
    roots: list[Path]
    before: dict[str, tuple[str, int, int]] = field(default_factory=dict)

    def snapshot(self) -> dict[str, tuple[str, int, int]]:
        out: dict[str, tuple[str, int, int]] = {}
        for r in self.roots:
            out.update(listing(r))
        return out

    def start(self) -> None:
        self.before = self.snapshot()

    def changes(self) -> list[str]:
        after = self.snapshot()
        added = sorted(set(after) - set(self.before))
        removed = sorted(set(self.before) - set(after))
        changed = sorted(p for p in set(after) & set(self.before) if after[p] != self.before[p])
        return ([f"added {p}" for p in added[:20]] + [f"removed {p}" for p in removed[:20]]
                + [f"rewritten {p}" for p in changed[:20]])
