"""Tensor parallel as a transport (issue 47): the rank group is handed on as an argument, never found on the
model, and the step plan's codec names no feature (each registers its own section).

A real group of one process (RankGroup.join at world 1, as bench_tensor_parallel.py loads a whole model
through a rank's loader) loads a tiny checkpoint's shard: no module of it carries the group except the
parallel layer types of the tensor-parallel wing that take it when they are built; the source scans hold
for the whole package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from bulkgen.engine.parallel.tensor_parallel import RankGroup, load_shard

PACKAGE = Path(__file__).resolve().parents[2] / "bulkgen"
ENGINE = PACKAGE / "engine"
WING = re.compile(
    r"^bulkgen\.engine\.parallel\.(layers|shard_\w+|sharding)$"
)  # the parallel layer types' homes


@pytest.fixture
def group():
    ranks = RankGroup.join("127.0.0.1", 0, 0, 1, "cpu", 30)
    yield ranks
    ranks.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_loaded_shard_carries_its_group_only_in_parallel_layers(group, tiny_model, arch):
    """The shard comes back beside its group (tensor_parallel.Shard); the model, and every module that is
    not a parallel layer type, holds no reference to the group: the runner and the features get it as an
    argument. The vocabulary-split embedding and head (and Qwen3's whole-width q/k norms) do hold it,
    as their constructor argument."""
    shard = load_shard(tiny_model(arch, seed=5), group, torch.float32)
    assert shard.group is group and shard.vlm is None
    holders = {
        name or "<root>": type(module)
        for name, module in shard.model.named_modules()
        if any(value is group for value in vars(module).values())
    }
    assert holders, "no parallel layer holds the group: the check below would prove nothing"
    wrong = {name: kind.__name__ for name, kind in holders.items() if not WING.match(kind.__module__)}
    assert wrong == {}
    assert "<root>" not in holders
    assert not any(hasattr(module, "bulkgen_tp") for module in shard.model.modules())


def _names(tree: ast.AST) -> set[str]:
    """Every identifier, attribute and string constant in `tree`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return found


def test_no_module_reads_or_sets_a_group_on_the_model():
    """`bulkgen_tp` (the group that rode on the model and that every feature looked up) appears nowhere in
    the package's code, as an attribute or as a getattr's string."""
    users = sorted(
        str(file.relative_to(PACKAGE))
        for file in PACKAGE.rglob("*.py")
        if any("bulkgen_tp" in name for name in _names(ast.parse(file.read_text())))
    )
    assert users == []


def test_the_plan_codec_names_no_feature():
    """plan_codec.py frames the sections the features register; it names none of them (LoRA, images,
    hybrid state slots), nor imports a feature's module."""
    tree = ast.parse((ENGINE / "parallel" / "plan_codec.py").read_text())
    features = re.compile(r"lora|adapter|image|vision|mrope|state_slot|states", re.IGNORECASE)
    named = sorted(name for name in _names(tree) if features.search(name) and "\n" not in name)
    imported = sorted(
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    )
    assert named == [] and imported == ["__future__", "bulkgen.engine.step_features", "dataclasses"]
