"""The tiers tests/conftest.py sets from what each test starts (tests/support/tiers.py): pytest's own
selection, in a fresh pytest, over tests whose tier is known from what they do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT = "tests/engine/test_block_manager.py::test_construction_builds_no_per_block_state"
# a local Ray through the `service` fixture
RAY = "tests/service/test_openai_roundtrip.py::test_shared_system_prompt_reports_cached_tokens"
# two gloo ranks: the follower process starts in the module's fixture (`tensor_parallel=2`)
RANKS = "tests/engine/test_tensor_parallel.py::test_two_ranks_hold_half_the_heads"
# a probe process in the test's own body, beside fast tests of the same module
PROBE = "tests/engine/test_quantize_fp8.py::test_quantizing_holds_at_most_one_float_layer_more"
BESIDE = "tests/engine/test_quantize_fp8.py::test_quantize_rows_round_trip_and_zero_rows"


def _selected(marker: str, *targets: str) -> set[str]:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker]
        + list(targets),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return {line.split("[")[0] for line in run.stdout.splitlines() if "::" in line}


def test_the_fast_tier_holds_unit_tests_and_leaves_out_what_starts_ray_a_server_or_a_process():
    targets = (UNIT, RAY, RANKS, PROBE, BESIDE)
    assert _selected("fast", *targets) == {UNIT, BESIDE}
    assert _selected("(ray and server) or subprocess", *targets) == {RAY, RANKS, PROBE}
