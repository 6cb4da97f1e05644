"""Structured outputs with images through the real service and the openai client, on the tiny LLaVA that
test_images_vlm.py runs (tests/service/conftest.py): chat lines with an `image_url` part and
`response_format` json_schema (greedy, and sampled with n and a seed) or json_object, and a responses line
with `input_image` and `text.format` json_schema, each answered with a document that parses against its
schema; the SDK's own types read every output line. The model has random weights: the documents come from the grammar."""

from __future__ import annotations

import json

import jsonschema
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from tests.support.images import VLM, data_url, image_bytes
from tests.support.schemas import ANIMAL
from tests.support.service import chat_row, read_lines, upload, wait_done, write_jsonl

SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "animal", "schema": ANIMAL, "strict": True}}


def _image(color: tuple[int, int, int]) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image_bytes("PNG", (32, 24), color))}}


def _chat(custom_id: str, color, response_format: dict, max_tokens: int = 48, **body) -> dict:
    content = [_image(color), {"type": "text", "text": "Which animal, and how many?"}]
    return chat_row(custom_id, content, max_tokens, model=VLM, response_format=response_format, **body)


def _batch(client, path, endpoint: str) -> tuple[object, list[dict], list[dict]]:
    batch = client.batches.create(
        input_file_id=upload(client, path).id, endpoint=endpoint, completion_window="24h"
    )
    batch = wait_done(client, batch.id, timeout=300)
    errors = read_lines(client, batch.error_file_id) if batch.error_file_id else []
    return batch, read_lines(client, batch.output_file_id), errors


def test_chat_lines_with_images_answer_documents_of_their_schema(vlm_client, tmp_path):
    rows = [
        _chat("greedy-red", (200, 30, 30), SCHEMA_FORMAT),
        _chat("greedy-blue", (20, 40, 220), SCHEMA_FORMAT),
        _chat("sampled", (30, 160, 40), SCHEMA_FORMAT, temperature=1.0, n=3, seed=7),
        _chat("object", (90, 90, 90), {"type": "json_object"}, max_tokens=64),
    ]
    batch, lines, errors = _batch(
        vlm_client, write_jsonl(tmp_path / "in.jsonl", rows), "/v1/chat/completions"
    )
    assert (batch.status, batch.request_counts.completed, errors) == ("completed", 4, [])
    output = {line["custom_id"]: ChatCompletion.model_validate(line["response"]["body"]) for line in lines}
    for custom_id in ("greedy-red", "greedy-blue", "sampled"):
        choices = output[custom_id].choices
        assert len(choices) == (3 if custom_id == "sampled" else 1)
        for choice in choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), ANIMAL)
    # the image's placeholder tokens are prompt tokens of a structured line as of any other
    assert output["greedy-red"].usage.prompt_tokens == output["greedy-blue"].usage.prompt_tokens
    obj = output["object"].choices[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)


def test_a_responses_line_with_an_input_image_answers_a_document_of_its_schema(vlm_client, tmp_path):
    content = [
        {"type": "input_text", "text": "Which animal, and how many?"},
        {"type": "input_image", "image_url": data_url(image_bytes("PNG", (20, 20), (0, 120, 0)))},
    ]
    body = {
        "model": VLM,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": 48,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "animal", "schema": ANIMAL, "strict": True}},
    }
    row = {"custom_id": "resp", "method": "POST", "url": "/v1/responses", "body": body}
    batch, lines, errors = _batch(vlm_client, write_jsonl(tmp_path / "resp.jsonl", [row]), "/v1/responses")
    assert (batch.status, batch.request_counts.completed, errors) == ("completed", 1, [])
    response = Response.model_validate(lines[0]["response"]["body"])
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), ANIMAL)
