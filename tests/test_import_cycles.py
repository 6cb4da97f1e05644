"""No import cycle anywhere in bulkgen, function-level imports included: a module imported inside a function
to dodge a circular import at load time is still a circle in the design (issue 47 found twelve engine
modules tied that way). `if TYPE_CHECKING:` imports do not count (annotations only, never run). The layer
and wing contracts are import-linter's (pyproject.toml, run by .ci/run); import-linter reads function-level
imports too but does not look for cycles inside a layer, which this does."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    for file in (root / package).rglob("*.py"):
        parts = file.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under an `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its file (top level or inside functions).
    `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, file in modules.items():
        tree = ast.parse(file.read_text(), str(file))
        skipped = _type_checking_only(tree)
        here = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (
                    ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else node.module or ""
                )
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_bulkgen_has_no_import_cycle():
    graph = import_graph(ROOT, "bulkgen")
    assert len(graph) > 150 and any(graph.values())  # it read the package, and found its imports
    assert cycles(graph) == []


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    """The check itself: a package whose two modules import each other, one of them inside a function (the
    engine's old lora <-> lora_slots), and a TYPE_CHECKING import that must not count."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("def thing():\n    from .a import other\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import x\n"
    )
    (package / "d.py").write_text("from pkg import c\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
