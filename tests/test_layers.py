"""The package's folders are its layers, and imports only run downward (README.md, "Layout").

Read from the source, not from sys.modules: every `import` and `from ... import` of every module,
including those inside functions (the lazy ones a command line uses to start fast), is an edge;
only those under `if TYPE_CHECKING:` are not, since they never run.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nano_engine"

# The floor of each folder (the package's top level is the engine the chapters build).
LAYERS = {"checks": 0, "kernels": 1, "models": 1, "parallel": 1, "": 2, "lab": 3, "serving": 3, "benchmarks": 3, "cli": 4,
          "__main__": 5}


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, root: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules that `path` imports (a `from package import module` counts as the module)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for block in ast.walk(tree):  # `if TYPE_CHECKING:` imports never run: annotations only
        if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING":
            block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    # A module's own packages run before it in any case: `from .. import checks` is an edge to checks.
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in found if m in known} - {name} - ancestors


def graph(root: pathlib.Path) -> dict[str, set[str]]:
    files = sorted(root.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    return {module_name(f, root): imports_of(f, root, known) for f in files}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def folder_of(module: str) -> str:
    parts = module.split(".")[1:]  # without "nano_engine"
    if not parts:
        return ""
    if len(parts) == 1:
        return parts[0] if parts[0] in LAYERS else ""
    return parts[0]


def test_every_module_is_on_a_known_floor():
    assert {folder_of(m) for m in graph(PACKAGE)} <= set(LAYERS)


def test_imports_only_run_downward():
    """A module imports its own folder or a lower floor: never a folder beside it or above it."""
    upward = [f"{m} -> {t}" for m, targets in graph(PACKAGE).items() for t in sorted(targets)
              if folder_of(t) != folder_of(m) and LAYERS[folder_of(t)] >= LAYERS[folder_of(m)]]
    assert upward == []


@pytest.mark.parametrize("root", ["nano_engine", "practice", "bench"])
def test_no_import_circle(root):
    assert cycles(graph(ROOT / root)) == []


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
    """The walk itself: a relative import inside a function, a `from . import module`, a circle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    edges = graph(pkg)
    assert edges["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and edges["pkg.sub.b"] >= {"pkg.a"}
    assert cycles(edges) == [["pkg.a", "pkg.sub.b"]]
