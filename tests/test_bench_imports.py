"""The benchmark scripts import what the package has: every `from bulkgen... import name` in bench/ and
jobs/ (at the top or inside a function, where the scripts defer their heavy imports) names a module and
an attribute that exist, so a module moved or renamed in the package cannot leave a script broken until
someone runs it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("jobs/*.py")])


def package_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of each import of a bulkgen module in the script."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("bulkgen"):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.startswith("bulkgen")]
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_package_import_of_a_script_resolves(script):
    imports = package_imports(script)
    missing = []
    for line, module, name in imports:
        try:
            imported = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{script.name}:{line}: {module} ({exc})")
            continue
        if name is not None and not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{script.name}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)


def test_the_scan_sees_deferred_imports():
    inside = [i for s in SCRIPTS for i in package_imports(s)]
    assert any(module == "bulkgen.runtime.driver" for _, module, _ in inside)
