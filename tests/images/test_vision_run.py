"""`bulkgen run samples/vision.jsonl` on the tiny LLaVA (docs/vision.md's "Try it"): every line answered,
image lines with their image tokens counted as prompt tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoProcessor

from bulkgen.cli import cli
from bulkgen.lab.tiny_vision import build_tiny_vlm
from tests.support.images import VLM, image_tokens

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "vision.jsonl"


@pytest.mark.slow  # a local Ray, as every `bulkgen run` test
def test_bulkgen_run_answers_every_line_of_the_vision_sample(tmp_path):
    model = build_tiny_vlm(tmp_path / "vlm", "llava", seed=3)
    out = tmp_path / "vision.out.jsonl"
    args = ["run", str(SAMPLE), "--model", f"{VLM}={model}", "--output", str(out)]
    result = CliRunner().invoke(cli, [*args, "--storage", str(tmp_path / "store")])
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert result.exit_code == 0, result.output
    assert f"{len(rows)} completed, 0 failed" in result.output, result.output
    answered = {x["custom_id"]: x["response"] for x in map(json.loads, out.read_text().splitlines())}
    assert sorted(answered) == sorted(r["custom_id"] for r in rows)
    per_image = image_tokens(AutoProcessor.from_pretrained(model))
    for row in rows:
        parts = [p for m in row["body"]["messages"] if isinstance(m["content"], list) for p in m["content"]]
        images = sum(p["type"] == "image_url" for p in parts)
        usage = answered[row["custom_id"]]["body"]["usage"]
        assert answered[row["custom_id"]]["status_code"] == 200
        assert usage["prompt_tokens"] > images * per_image  # each image's placeholders, and the text
