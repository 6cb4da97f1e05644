"""The engine's sub-packages show its architecture (issue 47): the step loop at the top of bulkgen/engine,
attention, the KV cache, a model's loading, the step features, sampling and the tensor-parallel wing each in
a package that says in its docstring what it owns. Their import rules are import-linter contracts
(pyproject.toml, run by .ci/run); this keeps a new module from landing loose at the top."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "bulkgen" / "engine"
SUBPACKAGES = {"attention", "kv", "model", "features", "parallel", "sampling"}
# the step loop and what every part of it shares (a sequence, one step's plan, the feature seam, the config)
TOP = {
    "__init__",
    "config",
    "decode_graphs",
    "engine",
    "heap",
    "model_runner",
    "outputs",
    "overlap",
    "pretrained",
    "process_memory",
    "scheduler",
    "sequence",
    "sketch",
    "stats",
    "step_features",
    "step_plan",
    "waiting",
}


def test_the_engine_top_level_holds_the_step_loop_only():
    loose = {p.stem for p in ENGINE.glob("*.py")} - TOP
    assert not loose, f"put {sorted(loose)} in one of the engine's sub-packages {sorted(SUBPACKAGES)}"


def test_each_sub_package_says_what_it_owns_and_names_its_modules():
    found = {p.parent.name for p in ENGINE.glob("*/__init__.py")}
    assert found == SUBPACKAGES
    for name in SUBPACKAGES:
        package = ENGINE / name
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        assert len(doc.split()) >= 30, f"bulkgen/engine/{name}/__init__.py: a paragraph on what it owns"
        unnamed = [p.stem for p in package.glob("*.py") if p.stem != "__init__" and p.stem not in doc]
        assert not unnamed, f"bulkgen/engine/{name}/__init__.py's docstring does not name {unnamed}"
