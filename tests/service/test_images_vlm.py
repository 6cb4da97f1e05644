"""Image lines end to end on a tiny vision-language model (lab/tiny_vision.py's LLaVA), through the real
service and the openai client: samples/vision.jsonl completes beside a line whose image is truncated (its
header reads, so validation passes it; the worker's decode refuses it, naming the part); a responses
line with input_image by data: URL and by a `vision` file id completes; usage counts each image's
placeholder tokens as prompt tokens, exactly as the model's processor expands them.

The session's service serves two text models; `vlm_client` (tests/service/conftest.py) adds the VLM to its
settings for a test (monkeypatch, undone after), so the same service, workers and Ray run it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from transformers import AutoProcessor

from tests.support.images import VLM, data_url, image_bytes, image_tokens, text_tokens
from tests.support.service import read_lines, upload, wait_done, write_jsonl

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "vision.jsonl"


def _run(client, tmp_path, name: str, rows: list, endpoint: str):
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / f"{name}.jsonl", rows)).id,
        endpoint=endpoint,
        completion_window="24h",
    )
    batch = wait_done(client, batch.id, timeout=300)
    outputs = {
        line["custom_id"]: line["response"]["body"] for line in read_lines(client, batch.output_file_id)
    }
    errors = {
        line["custom_id"]: line["response"]["body"]["error"]
        for line in read_lines(client, batch.error_file_id)
    }
    return batch, outputs, errors


def test_the_vision_sample_runs_beside_a_truncated_image(vlm_client, vlm_path, tmp_path):
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    png = image_bytes("PNG", (64, 64), (10, 20, 30))
    truncated = json.loads(json.dumps(rows[0]))
    truncated["custom_id"] = "truncated"
    truncated["body"]["messages"][0]["content"][0]["image_url"]["url"] = data_url(png[: len(png) // 2])
    batch, outputs, errors = _run(vlm_client, tmp_path, "vision", [*rows, truncated], "/v1/chat/completions")
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 8, 1)
    assert sorted(outputs) == sorted(row["custom_id"] for row in rows)
    assert (errors["truncated"]["code"], errors["truncated"]["param"]) == (
        "invalid_image",
        "body.messages[0].content[0].image_url",
    )
    processor = AutoProcessor.from_pretrained(vlm_path, local_files_only=True)
    per_image = image_tokens(processor)
    assert per_image > 1
    # the same question with and without its image: the image adds exactly the processor's placeholder run
    twice = outputs["compare-two"]["usage"]["prompt_tokens"]
    assert twice == text_tokens(processor, rows[5]) + 2 * per_image
    assert (
        outputs["caption-red-square"]["usage"]["prompt_tokens"] == text_tokens(processor, rows[0]) + per_image
    )


def test_responses_input_image_by_data_url_and_by_file_id(vlm_client, tmp_path):
    png = image_bytes("PNG", (20, 20), (0, 120, 0))
    image = vlm_client.files.create(file=("leaf.png", io.BytesIO(png)), purpose="vision")
    rows = [
        _responses_row("by-url", {"image_url": data_url(png)}),
        _responses_row("by-file", {"file_id": image.id}),
    ]
    batch, outputs, errors = _run(vlm_client, tmp_path, "responses", rows, "/v1/responses")
    assert (batch.request_counts.completed, batch.request_counts.failed, errors) == (2, 0, {})
    assert {body["object"] for body in outputs.values()} == {"response"}
    # the same pixels by either door: the same prompt, so the same greedy answer and usage
    by_url, by_file = outputs["by-url"], outputs["by-file"]
    assert by_url["output"][0]["content"][0]["text"] == by_file["output"][0]["content"][0]["text"]
    assert by_url["usage"]["input_tokens"] == by_file["usage"]["input_tokens"]


def _responses_row(custom_id: str, image: dict) -> dict:
    content = [
        {"type": "input_text", "text": "Describe it."},
        {"type": "input_image", "detail": "auto", **image},
    ]
    body = {
        "model": VLM,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": 16,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}
