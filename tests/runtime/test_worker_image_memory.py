"""A worker's image memory is bounded by its budget (`--image-memory-mb`), whatever the lines carry: images
are costed from their headers before any pixel is decoded, decoded a line (or a few) at a time as the
budget allows, and a line whose images alone cost more than the budget is refused. Each case runs the
worker in a fresh process (tests/runtime/image_memory_probe.py) and reads its peak RSS.

The hostile input of issue 46: 7000x7000 PNGs (159 KB each as RGB, 212 KB of base64; under
--max-image-pixels) cost ~650 MB each in the worker once decoded and processed; before the budget, 3 lines
of 4 such images grew the worker by 3.7 GB, since it started every image of a range at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.test_worker_images import VLM
from tests.support.images import data_url, image_bytes
from tests.support.service import chat_row

pytestmark = pytest.mark.slow  # a subprocess each, ~20 s of decoding

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
BUDGET_MIB = 1024


@pytest.fixture(scope="module")
def model(vlm_path):
    return str(vlm_path)


@pytest.fixture(scope="module")
def huge():
    """A 7000x7000 RGB PNG as a data: URL: 212 KB of base64, 196 MB as Pillow holds it."""
    return data_url(image_bytes("PNG", (7000, 7000), (10, 20, 30)))


def _row(custom_id: str, urls: list[str]) -> dict:
    row = chat_row(custom_id, "", max_tokens=2, model=VLM)
    row["body"]["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [
        {"type": "text", "text": "What is it?"}
    ]
    return row


def _probe(model: str, rows: list[dict], tmp_path: Path) -> dict:
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "tests.runtime.image_memory_probe", model, str(tmp_path / "rows.json")]
    done = subprocess.run(
        [*args, str(tmp_path), str(BUDGET_MIB)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    return json.loads(results[-1].removeprefix("RESULT "))


def test_hostile_lines_of_huge_images_are_refused_before_any_pixel_is_decoded(model, huge, tmp_path):
    """3 lines of 4 7000x7000 PNGs (2.5 MB of JSONL): each image costs 748 MiB by its header, so the second
    one of each line takes the line past the 1 GiB budget and the line is refused, naming that image and
    its decoded size; the worker grows by the encoded bytes only (it grew by 3.7 GB before the budget)."""
    out = _probe(model, [_row(f"hostile-{i}", [huge] * 4) for i in range(3)], tmp_path)
    assert out["errors"] == []
    for line in (1, 2, 3):
        code, param, message = out["lines"][str(line)]
        assert (code, param) == ("image_too_large", "body.messages[0].content[1].image_url")
        assert "7000x7000 pixels (RGB), 748 MiB once decoded and processed" in message
        assert "over a worker's image memory of 1,024 MiB (--image-memory-mb)" in message
    assert out["growth"] < 256 * MIB, f"the worker grew by {out['growth'] / MIB:.0f} MiB"
    assert out["budget_peak"] == 0 and out["budget_used_after"] == 0


def test_lines_of_huge_images_wait_for_the_budget_and_all_run(model, huge, tmp_path):
    """6 lines of one 7000x7000 PNG each: every one fits the 1 GiB budget alone, so they decode one at a time
    and all answer; the worker's peak growth stays under the budget (4 at once, one per decoding thread,
    before it), and the budget is whole again once the requests ended and their tensors were freed."""
    out = _probe(model, [_row(f"big-{i}", [huge]) for i in range(6)], tmp_path)
    assert out["errors"] == [] and out["lines"] == {str(line): "ok" for line in range(1, 7)}
    assert out["growth"] < BUDGET_MIB * MIB, f"the worker grew by {out['growth'] / MIB:.0f} MiB"
    assert 0 < out["budget_peak"] <= BUDGET_MIB * MIB and out["budget_used_after"] == 0
