"""A ratchet on the engine's step path: how many of its branch tests name a feature (LoRA, images, hybrid
state slots, grammar, prompt logprobs, pooling, tensor parallel). Each such `if` is a feature the
scheduler, runner or engine knows by name instead of calling through a seam (issue 47: "the less common the
feature, the more it should be hidden"); the count may fall, never grow. Lower CEILING when a feature moves
behind its seam; the goal is 15 over the four modules.

Counted: the test of every `if`/`elif`, `while`, conditional expression and comprehension filter whose source
matches a feature's pattern (the first matching feature counts it once)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "bulkgen" / "engine"
FEATURES = {
    "lora": r"lora|adapter",
    "images": r"image|vision|encoder|mm_|multimodal",
    "state_slots": r"\bstates?\b|state_slot|recurrent|mixer",
    "grammar": r"grammar|guide|structured",
    "prompt_logprobs": r"prompt_logprobs",
    "pooling": r"pool|embed",
    "tensor_parallel": r"\btp\b|tensor_parallel|rank",
}
# measured on 2026-12-04: engine.py 25, scheduler.py 8, model_runner.py 25, overlap.py 2 before the step-feature
# seam (step_features.py, 60 in all); after state slots, images, LoRA and the rank group moved behind it (26 in all;
# what remains in engine.py is mostly loading, the request edge, grammar and pooling; 24 with the reasoning gate
# merged); after loading moved to pretrained.py, image and embedding intake to their features and the overlapped
# path's grammar rows to the engine's one sampler call (15 in all):
CEILING = {
    "engine.py": 10,
    "scheduler.py": 2,
    "model_runner.py": 3,
    "overlap.py": 0,
}


def feature_checks(source: str) -> dict[str, list[str]]:
    """feature -> the source of each branch test that names it."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            conditions = [node.test]
        elif isinstance(node, ast.comprehension):
            conditions = node.ifs
        else:
            continue
        for condition in conditions:
            text = ast.unparse(condition)
            feature = next((name for name, pattern in FEATURES.items() if re.search(pattern, text)), None)
            if feature is not None:
                found.setdefault(feature, []).append(text)
    return found


def test_the_step_path_names_no_more_features_than_it_did():
    counts = {}
    for module, ceiling in CEILING.items():
        checks = feature_checks((ENGINE / module).read_text())
        counts[module] = sum(map(len, checks.values()))
        detail = {feature: len(tests) for feature, tests in checks.items()}
        assert counts[module] <= ceiling, (
            f"{module}: {counts[module]} feature checks (ceiling {ceiling}): {detail}"
        )
    print(f"feature checks in the step path: {counts} (total {sum(counts.values())}, goal 15)")


def test_the_count_sees_a_feature_check():
    """The counter itself: a branch on an adapter and one on the tensor-parallel group count, a plain one
    does not."""
    source = (
        "def step(self, batch):\n"
        "    if self.loras is not None and batch.adapters:\n        pass\n"
        "    rows = [r for r in batch if self.tp is None]\n"
        "    if batch.empty:\n        return\n"
    )
    assert feature_checks(source) == {
        "lora": ["self.loras is not None and batch.adapters"],
        "tensor_parallel": ["self.tp is None"],
    }
