"""Every command, file, flag, config key and link the documentation shows exists (README.md, docs/*.md and the
dated results in benchmarks/results/*.md).

* A ``bash`` code block's commands, and an inline code span that starts a command (``k3train ...``, ``python ...``,
  ``tools/X.py ...``, ``benchmarks/X.py ...``, ``make ...``, ``torchrun ...``): the script, module, ``k3train``
  subcommand or make target exists, and every ``--flag`` it passes is in that command's argument parser (read from
  its ``--help``, which each tool prints without doing any work); a ``--section.key=value`` override names a field
  of the run config (the ``k3train.config`` dataclasses).
* A path under a source folder (``k3train/``, ``tools/``, ``configs/``, ``docs/``, ...) in any code block or span
  exists; so does a dotted ``k3train.x.y`` name, a ``Class.member`` of the source tree, and a ``section.key``.
* A relative link resolves, its ``#anchor`` too; every docs page is one click from the README.

The checks can fail: ``test_the_checker_finds_made_up_names`` runs them on a page that names a made-up file, flag,
key, anchor and page.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from k3train.config import Config

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks/results").glob("*.md"))]
SOURCE_ROOTS = ("k3train", "parallel", "moonep", "kcp", "tools", "benchmarks", "configs", "docs", "tests", ".ci")
FENCE_LANGUAGES = {"bash": "commands", "text": "output", "python": "code", "yaml": "config", "json": "data"}
PYTHONS = {"python", "python3", "python3.11", ".venv/bin/python", "$(PY)"}
PLACEHOLDER_SECTION = "section"  # --section.key=value: the syntax, not a key

FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?:^|[\s\[|\"'(=])(--[A-Za-z][\w.-]*)")
PATH = re.compile(rf"(?<![\w./<-])((?:{'|'.join(re.escape(r) for r in SOURCE_ROOTS)})/[\w./-]*)")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
ENV = re.compile(r"^[A-Za-z_]\w*=")
DOTTED = re.compile(r"^((?:k3train|parallel|moonep|kcp)(?:\.\w+)+)(\(.*\))?$", re.DOTALL)
MEMBER = re.compile(r"^([A-Z]\w+)\.(\w+)(\(.*\))?$", re.DOTALL)


# ---------------------------------------------------------------------------------------------------------------
# what exists
# ---------------------------------------------------------------------------------------------------------------
@functools.cache
def config_keys() -> dict[str, set[str]]:
    cfg = Config()
    return {f.name: {g.name for g in dataclasses.fields(getattr(cfg, f.name))} for f in dataclasses.fields(cfg)
            if dataclasses.is_dataclass(getattr(cfg, f.name))}


@functools.cache
def make_targets() -> dict[str, str]:
    """Makefile target -> its recipe (the tab-indented lines after it)."""
    out: dict[str, str] = {}
    lines = (ROOT / "Makefile").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^([\w.-]+):(?!=)", line)
        if m:
            recipe = []
            for nxt in lines[i + 1:]:
                if not nxt.startswith("\t"):
                    break
                recipe.append(nxt.strip().rstrip("\\"))
            out[m.group(1)] = " ".join(recipe)
    return out


@functools.cache
def console_script() -> tuple[str, str]:
    """(module, function) of the ``k3train`` command (pyproject.toml's [project.scripts])."""
    module, func = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["k3train"].split(":")
    return module, func


def _help_argv(tool: tuple[str, ...]) -> list[str]:
    kind, name, *sub = tool
    if kind == "script":
        return [sys.executable, str(ROOT / name), *sub, "--help"]
    if kind == "module":
        return [sys.executable, "-m", name, *sub, "--help"]
    module, func = console_script()  # kind == "k3train": name is the subcommand
    return [sys.executable, "-c", f"import sys; from {module} import {func} as m; sys.exit(m(sys.argv[1:]))",
            name, *sub, "--help"]


@functools.cache
def parser_of(tool: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str], str]:
    """(long flags, subcommands, error) of a tool's argument parser, read from its ``--help``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run(_help_argv(tool), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    if p.returncode != 0:
        return frozenset(), frozenset(), f"{' '.join(tool[1:])} --help: exit {p.returncode}: {p.stderr[-300:]}"
    flags: set[str] = set()
    subs: set[str] = set()
    usage, _, rest = p.stdout.partition("\n\n")
    if usage.startswith("usage:"):
        flags.update(re.findall(r"\[(--[\w-]+)", usage))
        flags.update(re.findall(r"(?:^|\s)(--[\w-]+)", usage))
        for m in re.finditer(r"(\S*)\s+\{([\w,-]+)\}", usage):  # a subparser's choices, not a flag's
            if not m.group(1).lstrip("[").startswith("-"):
                subs.update(m.group(2).split(","))
    for line in rest.splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line)
        if m:
            flags.update(re.findall(r"--[\w-]+", m.group(1)))
    return frozenset(flags), frozenset(subs), ""


@functools.cache
def classes() -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for root in SOURCE_ROOTS[:6]:
        for p in (ROOT / root).rglob("*.py"):
            for name in re.findall(r"^class (\w+)", p.read_text(), re.MULTILINE):
                out.setdefault(name, []).append(p)
    return out


def _defines(text: str, name: str) -> bool:
    return bool(re.search(rf"^\s*(?:def|class)\s+{name}\b|^\s*(?:self\.)?{name}\s*[:=]|"
                          rf"\bimport\b[^\n]*\b{name}\b|^\s+{name},", text, re.MULTILINE))


# ---------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------
def check_override(flag: str) -> str:
    """'' if ``--section.key`` names a config field, else the problem."""
    section, _, key = flag[2:].partition(".")
    if section == PLACEHOLDER_SECTION or key.isupper():
        return ""
    keys = config_keys()
    if section not in keys:
        return f"{flag}: no config section {section!r} (sections: {', '.join(keys)})"
    if key not in keys[section]:
        return f"{flag}: no config field {section}.{key}"
    return ""


def check_path(path: str) -> str:
    path = path.split("::")[0].rstrip(".,:;)")
    if not path or "*" in path:
        return ""
    return "" if (ROOT / path).exists() else f"{path}: no such file or folder"


def _tool(tokens: list[str]) -> tuple[tuple[str, ...] | None, list[str], str]:
    """(tool, its arguments, problem) of a command's tokens; tool None: not one of ours."""
    while tokens and ENV.match(tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None, [], ""
    head, rest = tokens[0], tokens[1:]
    if head in ("k3train", ".venv/bin/k3train", "$(VENV)/bin/k3train"):
        if not rest or rest[0].startswith("-"):
            return None, rest, ""
        return ("k3train", rest[0]), rest[1:], ""
    if head == "torchrun":
        if "-m" not in rest:
            return None, [], ""
        i = rest.index("-m")
        return ("module", rest[i + 1]), rest[i + 2:], ""
    if head in PYTHONS:
        if not rest or rest[0] == "-":
            return None, [], ""
        if rest[0] == "-m":
            return (("module", rest[1]), rest[2:], "") if rest[1] != "pytest" else (None, [], "")
        head, rest = rest[0], rest[1:]
    if head.endswith(".py") and head.startswith(("tools/", "benchmarks/")) and "<" not in head:
        if not (ROOT / head).is_file():
            return None, [], f"{head}: no such script"
        return ("script", head), rest, ""
    if head == "make":
        recipes = make_targets()
        default = next(t for t in recipes if not t.startswith("."))  # make's default goal: the first target
        target = next((t for t in rest if not ENV.match(t) and not t.startswith("-")), default)
        if target not in recipes:
            return None, [], f"make {target}: no such target in the Makefile"
        return ("make", target), rest, ""
    return None, [], ""


def _make_tool(target: str) -> tuple[str, ...] | None:
    """The tool a make target's recipe runs with the user's ARGS / LAYOUT."""
    recipe = make_targets()[target]
    m = re.search(r"bin/k3train (\S+)", recipe)
    if m:
        return ("k3train", m.group(1))
    m = re.search(r"((?:tools|benchmarks)/\w+\.py)", recipe)
    return ("script", m.group(1)) if m else None


def check_command(tokens: list[str]) -> list[str]:
    tool, args, problem = _tool(tokens)
    if problem:
        return [problem]
    if tool is None:
        return []
    if tool[0] == "make":
        tool = _make_tool(tool[1])
        args = [a.split("=", 1)[1] for a in args if ENV.match(a)]  # VAR="--flags ..." passed to the recipe's tool
    flags = [f for a in args for f in FLAG.findall(a)]
    problems = [check_override(f) for f in flags if "." in f]
    plain = [f for f in flags if "." not in f]
    if tool is None or not plain:
        return [p for p in problems if p]
    known, subs, error = parser_of(tool)
    if error:
        return [error]
    positional = [a for a in args if re.fullmatch(r"[a-z][\w-]*", a)]
    if subs and positional and positional[0] in subs:  # a subcommand's own parser
        sub_known, _, error = parser_of((*tool, positional[0]))
        if error:
            return [error]
        known = known | sub_known
    name = " ".join(tool[1:])
    problems += [f"{name}: no flag {f} (its --help lists {', '.join(sorted(known))})" for f in plain
                 if f not in known]
    return [p for p in problems if p]


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split("#")[0].split()


def bash_commands(block: str) -> list[list[str]]:
    """The token lists of a bash block's commands (continuations joined, heredoc bodies and comments left out)."""
    out, lines, i = [], block.splitlines(), 0
    pending = ""
    while i < len(lines):
        line = lines[i]
        i += 1
        heredoc = HEREDOC.search(line)
        if heredoc and not pending:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        for part in re.split(r"\s(?:&&|;|\|\|)\s", pending + line):
            toks = _tokens(part)
            if toks:
                out.append(toks)
        pending = ""
    return out


def is_command_span(span: str) -> bool:
    words = span.split()
    while words and ENV.match(words[0]):
        words = words[1:]
    return bool(words) and (words[0] in ("k3train", "make", "torchrun") or words[0] in PYTHONS
                            or re.match(r"(?:tools|benchmarks)/\w+\.py$", words[0]) is not None)


def check_span(span: str) -> list[str]:
    span = " ".join(span.split())
    problems = [check_path(p) for p in PATH.findall(span)]
    if is_command_span(span):
        problems += check_command(_tokens(span))
    sections = "|".join(config_keys())
    key = re.match(rf"^({sections})\.([A-Za-z_]\w*)(?![\w.])((?: / [A-Za-z_]\w*)*)", span)
    if key:  # a config key (`parallel.overlap_ep` is the key, not the package parallel/)
        problems += [check_override(f"--{key.group(1)}.{k}") for k in [key.group(2), *key.group(3).split(" / ")[1:]]]
    m = DOTTED.match(span)
    if m and not key:
        problems.append(check_dotted(m.group(1)))
    m = MEMBER.match(span)
    if m and m.group(1) in classes():
        files = classes()[m.group(1)]
        if not any(_defines(f.read_text(), m.group(2)) for f in files):
            problems.append(f"{span}: {m.group(1)} ({files[0].relative_to(ROOT)}) has no {m.group(2)}")
    return [p for p in problems if p]


def check_dotted(name: str) -> str:
    """'' if ``a.b.c`` is a module of the source tree, or a name a module of it defines."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        mod = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if mod.is_file():
            rest = parts[n:]
            if not rest or _defines(mod.read_text(), rest[0]):
                return ""
            return f"{name}: {mod.relative_to(ROOT)} defines no {rest[0]}"
    return f"{name}: no such module"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.MULTILINE):
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def check_link(page: Path, target: str) -> str:
    if re.match(r"^[a-z]+:", target):
        return ""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"link {target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"link {target}: no heading #{anchor} in {dest.relative_to(ROOT)}"
    return ""


def problems_of(page: Path, text: str) -> list[str]:
    """Every problem of one markdown page's text (``page``: where its relative links start)."""
    problems = []
    for lang, body in FENCE.findall(text):
        if lang not in FENCE_LANGUAGES:
            problems.append(f"a code block without a known language ({lang!r}; one of {', '.join(FENCE_LANGUAGES)})")
        problems += [check_path(p) for p in PATH.findall(body)]
        if lang == "bash":
            for tokens in bash_commands(body):
                problems += check_command(tokens)
    prose = FENCE.sub("", text)
    for span in SPAN.findall(prose):
        problems += check_span(span)
    for target in LINK.findall(SPAN.sub("", prose)):
        problems.append(check_link(page, target))
    return [p for p in problems if p]


# ---------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_command_file_flag_and_link_exists(page: Path) -> None:
    problems = problems_of(page, page.read_text())
    assert not problems, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


def test_every_page_is_one_click_away() -> None:
    """Every docs page is linked from the README; every results file from a docs page; the README stays short."""
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    assert [p.name for p in PAGES if p.parent == ROOT / "docs" and p not in linked] == []
    docs = " ".join(p.read_text() for p in PAGES if p.parent == ROOT / "docs")
    assert [p.name for p in PAGES if p.parent.name == "results" and f"results/{p.name}" not in docs] == []
    assert len(readme.splitlines()) <= 200


def test_the_checker_finds_made_up_names() -> None:
    page = ROOT / "docs" / "selfcheck.md"
    fine = ("# Title\n\nSee [running](running.md#threads) and `tools/plan.py --config configs/tiny.yaml --top 3`.\n\n"
            "```bash\nk3train train --config configs/tiny.yaml --nproc 2 --train.steps=5 \\\n    --parallel.pp=2\n"
            "make train ARGS=\"--train.steps=50\"\n.venv/bin/python benchmarks/bench_moonep.py layout\n```\n\n"
            "`parallel.overlap_ep`, `k3train.preflight.validate_run`, `ParallelDims.sided(\"cp\")`.\n")
    assert problems_of(page, fine) == []
    bad = {
        "`tools/no_such_tool.py --config configs/tiny.yaml`": "tools/no_such_tool.py",
        "`tools/plan.py --config configs/tiny.yaml --no-such-flag 3`": "no flag --no-such-flag",
        "```bash\nk3train train --config configs/tiny.yaml --train.no_such_key=1\n```": "train.no_such_key",
        "```bash\nk3train memory --config configs/tiny.yaml --world-size 2 --made-up\n```": "no flag --made-up",
        "```bash\nmake train ARGS=\"--nosection.steps=5\"\n```": "no config section 'nosection'",
        "```bash\nmake no-such-target\n```": "make no-such-target",
        "`configs/nope.yaml`": "configs/nope.yaml",
        "`data.no_such_field`": "data.no_such_field",
        "`k3train.preflight.no_such_function`": "defines no no_such_function",
        "`ParallelDims.no_such_member`": "has no no_such_member",
        "[a page](no-such-page.md)": "no-such-page.md",
        "[an anchor](running.md#no-such-heading)": "#no-such-heading",
        "```\nno language\n```": "without a known language",
    }
    for text, expected in bad.items():
        found = problems_of(page, fine + "\n" + text + "\n")
        assert any(expected in p for p in found), (text, found)
