"""Structured outputs through the real service and the openai client: `response_format` json_schema and
json_object, forced tool calls (`tool_choice` required or named, legacy `function_call`), and schemas that
cannot be used (refused by the compiler, admitting no document, too large, crashing the compiler, or
failing only as the output is written) each refused as that line's 400 naming its field, in one line,
while the rest of the batch runs; /health answers at once while a large schema compiles.

The service's model has random weights: it writes no JSON by itself, so a valid document in the output
comes from the grammar alone.
"""

from __future__ import annotations

import json
import threading
import time
from urllib.request import urlopen

import jsonschema
import pytest
from openai.types.chat import ChatCompletion

from tests.support.schemas import LATE_FAILURE, SLOW_TO_COMPILE, ref_chain
from tests.support.serve_process import ServeProcess
from tests.support.service import TOOLS_MODEL, chat_row, read_lines, upload, wait_done, wait_for, write_jsonl

LABEL = {
    "type": "object",
    "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
    "required": ["label"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "rush": {"type": "boolean"},
    },
    "required": ["items", "rush"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"const": "UTC"}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
# schemas no document can come out of, each its line's 400 (tests/engine/test_grammar.py has the why of each)
UNUSABLE = {
    "self-ref": ({"$ref": "#"}, "admits no document"),
    "lexer-pattern": ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "admits no document"),
    "crash": (ref_chain(1000), "crashed"),
    "huge": ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40_000)}}, "bytes"),
    "late-failure": (LATE_FAILURE, "failed during decoding"),  # found by the worker's engine, as it runs
}


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def client(service):
    return service.client()


@pytest.fixture(scope="module")
def results(client, tmp_path_factory):
    rows = [
        chat_row(
            "label",
            "Review: the soup was cold.",
            100,
            temperature=1.0,
            n=3,
            seed=1,
            response_format=_schema_format("label", LABEL),
        ),
        chat_row(
            "order",
            "Order two things.",
            200,
            temperature=0.7,
            seed=2,
            response_format=_schema_format("order", ORDER),
        ),
        chat_row("object", "Anything.", 60, temperature=0, response_format={"type": "json_object"}),
        chat_row(
            "named",
            "Weather in Oslo?",
            120,
            tools=TOOLS,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
        chat_row("required", "Any tool.", 150, tools=TOOLS, temperature=0.5, seed=4, tool_choice="required"),
        chat_row(
            "legacy",
            "Weather?",
            120,
            functions=[WEATHER],
            temperature=0,
            function_call={"name": "get_weather"},
        ),
        chat_row(
            "bad-schema", "x", response_format=_schema_format("bad", {"type": "string", "pattern": "(?<=a)b"})
        ),
        chat_row("plain", "Say hi", 4),
        *[
            chat_row(cid, "x", 150, response_format=_schema_format("s", s))
            for cid, (s, _) in UNUSABLE.items()
        ],
        chat_row(
            "late-tool",
            "x",
            150,
            tools=[{"type": "function", "function": {"name": "f", "parameters": LATE_FAILURE}}],
            tool_choice={"type": "function", "function": {"name": "f"}},
        ),
    ]
    for row in rows:  # one model per file: the one whose chat template renders tools
        row["body"]["model"] = TOOLS_MODEL
    path = write_jsonl(tmp_path_factory.mktemp("structured") / "in.jsonl", rows)
    batch = client.batches.create(
        input_file_id=upload(client, path).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_done(client, batch.id, timeout=300)
    assert batch.status == "completed", batch
    output = {
        line["custom_id"]: ChatCompletion.model_validate(line["response"]["body"])
        for line in read_lines(client, batch.output_file_id)
    }
    errors = {
        line["custom_id"]: line["response"]["body"]["error"]
        for line in read_lines(client, batch.error_file_id)
    }
    return batch, output, errors


def test_json_schema_outputs_validate(results):
    _, output, _ = results
    for cid, schema, choices in (("label", LABEL, 3), ("order", ORDER, 1)):
        completion = output[cid]
        assert len(completion.choices) == choices
        for choice in completion.choices:
            assert choice.finish_reason == "stop", (cid, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_mode_gives_an_object_or_is_cut_by_length(results):
    choice = results[1]["object"].choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_a_named_forced_call_carries_valid_arguments(results):
    choice = results[1]["named"].choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])


def test_required_calls_one_of_the_tools_with_its_own_arguments(results):
    choice = results[1]["required"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message.content
    (call,) = choice.message.tool_calls
    function = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), function["parameters"])


def test_legacy_function_call_by_name(results):
    message = results[1]["legacy"].choices[0].message
    assert message.function_call.name == "get_weather" and message.content is None
    jsonschema.validate(json.loads(message.function_call.arguments), WEATHER["parameters"])


def test_an_uncompilable_schema_is_its_lines_400_and_the_rest_runs(results):
    batch, output, errors = results
    assert set(errors) == {"bad-schema", "late-tool", *UNUSABLE}
    assert errors["bad-schema"]["param"] == "body.response_format"
    assert "look-around" in errors["bad-schema"]["message"]
    assert output["plain"].choices[0].message.tool_calls is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        14,
        7,
        7,
    )


def test_a_schema_no_document_comes_out_of_is_its_lines_400_never_an_empty_stop(results):
    """Refused at validation where the compiler can tell, else by the engine as the output is written;
    either way one line naming the field, without the compiler's native backtrace or parser state."""
    errors = results[2]
    for cid, (_, why) in UNUSABLE.items():
        error = errors[cid]
        assert error["param"] == "body.response_format" and why in error["message"], (cid, error)
        assert "\n" not in error["message"] and len(error["message"]) < 400, (cid, error)
        assert "backtrace" not in error["message"] and "<state>" not in error["message"]
    assert errors["late-tool"]["param"] == "body.tool_choice"
    assert "failed during decoding" in errors["late-tool"]["message"]


def test_health_answers_while_a_large_schema_compiles(tmp_path):
    """SLOW_TO_COMPILE takes seconds to compile: in the compiler's own process, so a real `bulkgen serve`
    keeps answering /health at once while it validates (it stalled for seconds while llguidance held the
    interpreter's lock). /health is polled without pause from this process, the server's being another."""
    serve = ServeProcess(str(tmp_path / "storage"))
    try:
        client = serve.client()
        warm = upload(client, write_jsonl(tmp_path / "warm.jsonl", [chat_row("warm", "hi", 2)]))
        warm = client.batches.create(
            input_file_id=warm.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert wait_done(client, warm.id).status == "completed"  # the workers are up: only the compile is new
        row = chat_row("slow", "x", 2, response_format=_schema_format("s", SLOW_TO_COMPILE))
        file = upload(client, write_jsonl(tmp_path / "slow.jsonl", [row]))
        latencies, done = [], threading.Event()

        def poll_health() -> None:
            while not done.is_set():
                asked = time.monotonic()
                with urlopen(f"http://127.0.0.1:{serve.port}/health", timeout=60) as response:
                    assert json.loads(response.read())["status"] == "ok"
                latencies.append(time.monotonic() - asked)

        poller = threading.Thread(target=poll_health)
        started = time.monotonic()
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        poller.start()
        batch = wait_for(client, batch.id, lambda b: b.status != "validating", 120)
        validating = time.monotonic() - started
        done.set()
        poller.join(60)
        assert validating > 2.0 and len(latencies) > 10  # long enough to measure /health against
        assert max(latencies) < validating / 10, (max(latencies), validating)
        (error,) = read_lines(client, wait_done(client, batch.id, timeout=300).error_file_id)
        assert error["response"]["body"]["error"]["param"] == "body.response_format"
    finally:
        serve.kill()
