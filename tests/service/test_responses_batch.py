"""A `/v1/responses` batch through the real service and the openai client: string and message-list input,
instructions, a max_output_tokens cut (incomplete), text.format json_schema and json_object, metadata echoed,
refused fields as named 400 lines, and the batch's usage counting the Response lines.

The service's model has random weights and almost never stops by itself, so an answer runs to its limit
(incomplete) unless a grammar closes it; a valid JSON document in the output comes from the grammar alone.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.types.responses import Response

from tests.support.service import MODEL, read_lines, upload, wait_done, write_jsonl

LABEL = {
    "type": "object",
    "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
    "required": ["label"],
    "additionalProperties": False,
}


def _row(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": MODEL, "temperature": 0, **body},
    }


ROWS = [
    _row("string", input="Say hi", max_output_tokens=16),
    _row(
        "messages",
        max_output_tokens=16,
        input=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Red."}]},
            {"role": "user", "content": "Another."},
        ],
    ),
    _row(
        "instructions",
        instructions="You label reviews.",
        input="The soup was cold.",
        max_output_tokens=16,
        metadata={"team": "support", "run": "7"},
    ),
    _row("cut", input="Tell me a long story.", max_output_tokens=16),
    _row("short", input="Hi.", max_output_tokens=15),  # under the spec's minimum: refused
    _row(
        "schema",
        input="Label: the soup was cold.",
        max_output_tokens=100,
        temperature=1.0,
        top_p=0.9,
        text={"format": {"type": "json_schema", "name": "label", "schema": LABEL, "strict": True}},
    ),
    _row("object", input="Anything.", max_output_tokens=40, text={"format": {"type": "json_object"}}),
    _row("tools", input="Weather?", tools=[{"type": "function", "name": "get_weather", "parameters": {}}]),
    _row("previous", input="And then?", previous_response_id="resp_123"),
    _row(
        "bad-schema",
        input="x",
        text={
            "format": {
                "type": "json_schema",
                "name": "bad",
                "schema": {"type": "string", "pattern": "(?<=a)b"},
            }
        },
    ),
]


@pytest.fixture(scope="module")
def client(service):
    return service.client()


@pytest.fixture(scope="module")
def results(client, tmp_path_factory):
    path = write_jsonl(tmp_path_factory.mktemp("responses") / "in.jsonl", ROWS)
    batch = client.batches.create(
        input_file_id=upload(client, path).id, endpoint="/v1/responses", completion_window="24h"
    )
    batch = wait_done(client, batch.id, timeout=300)
    lines = read_lines(client, batch.output_file_id)
    output = {line["custom_id"]: Response.model_validate(line["response"]["body"]) for line in lines}
    errors = {
        line["custom_id"]: line["response"]["body"]["error"]
        for line in read_lines(client, batch.error_file_id)
    }
    return batch, output, errors


def test_the_batch_completes_with_a_line_per_request(results):
    batch, output, errors = results
    assert batch.status == "completed" and batch.endpoint == "/v1/responses"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        10,
        6,
        4,
    )
    assert set(output) | set(errors) == {row["custom_id"] for row in ROWS}


def test_every_answer_is_a_response_with_its_text(results):
    _, output, _ = results
    for cid, response in output.items():
        assert response.object == "response" and response.id.startswith("resp_"), cid
        assert response.model == MODEL and len(response.output) == 1
        message = response.output[0]
        assert (message.type, message.role, message.status) == ("message", "assistant", response.status)
        assert response.output_text == message.content[0].text and response.output_text, cid
        usage = response.usage
        assert usage.input_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_max_output_tokens_cuts_to_incomplete(results):
    _, output, _ = results
    cut = output["cut"]
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 16 and cut.max_output_tokens == 16
    assert cut.completed_at is None


def test_instructions_and_message_history_reach_the_model(results):
    """The system message and the history are in the prompt: more input tokens than the user text alone."""
    _, output, _ = results
    assert output["instructions"].instructions == "You label reviews."
    assert output["instructions"].usage.input_tokens > output["string"].usage.input_tokens
    assert output["messages"].usage.input_tokens > output["string"].usage.input_tokens


def test_metadata_and_sampling_are_echoed(results):
    _, output, _ = results
    assert output["instructions"].metadata == {"team": "support", "run": "7"}
    assert output["string"].metadata == {}
    assert (output["schema"].temperature, output["schema"].top_p) == (1.0, 0.9)
    assert output["schema"].text.format.type == "json_schema" and output["schema"].text.format.name == "label"


def test_json_formats_hold_to_their_grammar(results):
    _, output, _ = results
    labelled = output["schema"]
    assert labelled.status == "completed"
    jsonschema.validate(json.loads(labelled.output_text), LABEL)
    if output["object"].status == "completed":  # the grammar allows long keys: 40 tokens may cut it
        assert isinstance(json.loads(output["object"].output_text), dict)
    else:
        assert output["object"].output_text.startswith("{")


def test_refused_fields_are_named_400_lines(results):
    _, _, errors = results
    assert {cid: (e["code"], e["param"]) for cid, e in errors.items()} == {
        "tools": ("unsupported_parameter", "body.tools"),
        "previous": ("unsupported_parameter", "body.previous_response_id"),
        "bad-schema": ("invalid_parameter", "body.text.format"),
        "short": ("invalid_parameter", "body.max_output_tokens"),
    }
    assert errors["short"]["message"] == "body.max_output_tokens must be an integer >= 16; got 15"


def test_batch_usage_counts_the_response_lines(results):
    batch, output, _ = results
    assert batch.usage.input_tokens == sum(r.usage.input_tokens for r in output.values())
    assert batch.usage.output_tokens == sum(r.usage.output_tokens for r in output.values())
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
