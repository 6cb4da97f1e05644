"""The service path reads without the lab: no module outside bulkgen/lab and the CLI that drives it
(bulkgen/cli) imports bulkgen.lab, so the API, the batch domain, the runtime and the planner load and
run without the simulator, the policy bench or the tiny test models."""

from __future__ import annotations

import ast
from pathlib import Path

import bulkgen

PACKAGE = Path(bulkgen.__file__).resolve().parent
LAB = "bulkgen.lab"
ALLOWED = {"lab", "cli"}  # the lab itself, and the commands (`simulate`, `bench`) that run it


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports inside functions count too),
    relative imports resolved against the module's own package."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from bulkgen import lab`
    return found


def lab_imports(paths: list[Path]) -> dict[str, list[str]]:
    out = {}
    for path in paths:
        hits = sorted(m for m in imported_modules(path) if m == LAB or m.startswith(LAB + "."))
        if hits:
            out[str(path.relative_to(PACKAGE.parent))] = hits
    return out


def service_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in ALLOWED]


def test_service_path_never_imports_the_lab():
    paths = service_modules()
    names = {p.relative_to(PACKAGE).parts[0] for p in paths}
    assert {"api", "batch", "runtime", "plan", "engine", "store", "watch", "settings.py"} <= names
    assert lab_imports(paths) == {}


def test_the_scan_sees_lab_imports_where_they_are():
    """The check above would pass on a scanner that finds nothing: it must find the CLI's lazy import
    of the policy bench and the lab's imports of its own modules."""
    found = lab_imports([PACKAGE / "cli" / "analysis.py", PACKAGE / "lab" / "sim" / "render.py"])
    assert "bulkgen.lab.policy_bench" in found["bulkgen/cli/analysis.py"]
    assert "bulkgen.lab.sim.batching" in found["bulkgen/lab/sim/render.py"]


def test_relative_imports_resolve_to_their_package():
    engine_module = PACKAGE / "engine" / "scheduler.py"
    assert "bulkgen.engine.kv.block_manager" in imported_modules(engine_module)
