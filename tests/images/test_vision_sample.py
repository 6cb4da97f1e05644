"""samples/vision.jsonl, as jobs/make_vision_sample.py writes it: every line passes validation, images
included (docs/vision.md runs it end to end on a tiny vision-language model)."""

from __future__ import annotations

import json
from pathlib import Path

from bulkgen.batch.images import check_images
from bulkgen.batch.requests import CHAT, parse_line
from bulkgen.settings import ImageSettings
from jobs.make_vision_sample import rows

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "vision.jsonl"


def test_the_vision_sample_validates_with_its_inline_images():
    lines = SAMPLE.read_text().splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == [row["custom_id"] for row in rows()]
    counts = {}
    for number, raw in enumerate(lines, 1):
        request = parse_line(raw, number, CHAT)
        check_images(request.images, store=None, policy=ImageSettings())
        counts[request.custom_id] = [ref.kind for ref in request.images]
    assert counts["compare-two"] == ["data", "data"] and counts["text-only"] == []
    assert sum(map(len, counts.values())) == 8
