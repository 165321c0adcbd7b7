"""The house's layers, read from the source's own imports (every ``import`` statement, also those inside functions;
``if TYPE_CHECKING:`` imports are types only and left out).

* No import circle between modules.
* No import runs back up: a module imports only modules of its own layer or of the layers below it.
* A function-local import says why it is there (``# lazy: <reason>``): only to keep a heavy or optional
  dependency off a start-up path, never to hide a circle.

The layer order is written down here, once (docs/architecture.md describes it): bottom first. A module belongs to
the longest prefix that names it.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("k3train", "parallel", "moonep", "kcp", "tools", "benchmarks")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("runtime: processes, signals, errors, caches", ("k3train.runtime",)),
    ("config: schema, checks, loading", ("k3train.config",)),
    ("kernels: ops, numerics, optimizers", ("k3train.ops", "k3train.quant", "k3train.optim")),
    ("model: plain nn.Modules", ("k3train.model",)),
    ("data, pipeline runtime, reporting", ("k3train.data", "parallel", "k3train.reporting")),
    ("parallel systems and checkpoints", ("kcp", "moonep", "k3train.checkpoint")),
    ("formats: drafts, Hugging Face, evaluation", ("k3train.draft", "k3train.hf", "k3train.evaluate")),
    ("assembly: parallelize, preflight", ("k3train.parallelize", "k3train.preflight")),
    ("the training loop", ("k3train.trainer",)),
    ("planning", ("k3train.planning",)),
    ("entry points", ("k3train.train", "k3train.cli", "k3train.hf_commands")),
    ("user commands", ("tools",)),
    ("benchmarks", ("benchmarks",)),
)

LAZY_REASON = re.compile(r"#.*\blazy: \S+")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))}


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (module == pre or module.startswith(pre + ".")) and len(pre) > best_len:
                best, best_len = i, len(pre)
    if best < 0:
        raise AssertionError(f"{module}: in no layer of tests/test_import_graph.py LAYERS")
    return best


class _Imports(ast.NodeVisitor):
    """(imported name, line, inside a function) of every import statement, TYPE_CHECKING blocks skipped."""

    def __init__(self, package: str) -> None:
        self.package, self.depth, self.found = package, 0, []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            pkg = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        for alias in node.names:
            self.found.append((f"{base}.{alias.name}", node.lineno, self.depth > 0))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module -> modules it imports (within the source dirs); and the function-local imports without a reason."""
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    unexplained = []
    for mod, path in modules.items():
        text = path.read_text()
        lines = text.splitlines()
        visitor = _Imports(mod if path.name == "__init__.py" else mod.rpartition(".")[0])
        visitor.visit(ast.parse(text))
        for name, line, local in visitor.found:
            target = _resolve(name, modules)
            if target and target != mod:
                edges[mod].add(target)
            if local and not LAZY_REASON.search(lines[line - 1]) and not LAZY_REASON.search(lines[line - 2]):
                unexplained.append(f"{path.relative_to(ROOT)}:{line}: import {name}")
    return edges, unexplained


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circle():
    edges, _ = import_graph()
    circles = _circles(edges)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_import_runs_back_up():
    edges, _ = import_graph()
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
              for a in sorted(edges) for b in sorted(edges[a]) if layer_of(b) > layer_of(a)]
    assert not upward, "imports that run back up a layer:\n" + "\n".join(upward)


def test_function_local_imports_say_why():
    _, unexplained = import_graph()
    assert not unexplained, (f"{len(unexplained)} function-local imports without '# lazy: <reason>' (move them to "
                             "the top of the module, or say what they keep off a start-up path):\n"
                             + "\n".join(unexplained))


def test_the_checker_sees_circles_and_upward_imports():
    """The checks themselves can fail: a two-module circle and an upward edge are found."""
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _circles({"a": {"b"}, "b": {"c"}}) == []
    assert layer_of("k3train.hf_commands") > layer_of("k3train.hf.load") > layer_of("k3train.model.moe")
    assert layer_of("k3train.runtime.signals") < layer_of("k3train.config")
