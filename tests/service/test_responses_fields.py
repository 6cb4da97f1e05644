"""The `/v1/responses` body, field by field (no server): each of CreateResponse's fields is honoured (it
becomes the same ParsedRequest a chat line makes), accepted and ignored, or refused by name; and the
Response object built from a result parses with the openai package's own type."""

from __future__ import annotations

import json
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response
from openai.types.responses.response_create_params import ResponseCreateParamsBase

from bulkgen.batch.bodyfields import BODY_FIELDS
from bulkgen.batch.outputlines import success_line
from bulkgen.batch.prepare import fit_context
from bulkgen.batch.requests import CHAT, RESPONSES, LineError, parse_line
from bulkgen.batch.resultfiles import parquet_row
from bulkgen.engine.features.guide import Guide
from bulkgen.watch.job import Job, JobError
from tests.service.test_body_fuzz import EDGES, JSON
from tests.service.test_body_fuzz import _run_like_a_worker as run_like_a_worker
from tests.support.service import MODEL, chat_row

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


def _row(**body) -> dict:
    return {
        "custom_id": "r",
        "method": "POST",
        "url": RESPONSES,
        "body": {"model": MODEL, "input": "hi", **body},
    }


def _parse(**body):
    return parse_line(json.dumps(_row(**body)), 1, RESPONSES)


def _refused(**body) -> tuple[str, str]:
    with pytest.raises(LineError) as info:
        _parse(**body)
    return info.value.code, info.value.param


def test_the_parser_knows_exactly_the_sdks_fields():
    """Every field of the openai package's ResponseCreateParams (plus `stream`, which it splits off)."""
    assert BODY_FIELDS[RESPONSES] == set(typing.get_type_hints(ResponseCreateParamsBase)) | {"stream"}


def test_a_responses_line_is_the_chat_request():
    """One request model underneath: the same messages, sampling and template options as the chat line."""
    got = _parse(
        input=[
            {"role": "developer", "content": "be brief"},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "h"}, {"type": "input_text", "text": "i"}],
            },
        ],
        max_output_tokens=17,
        temperature=0.5,
        top_p=0.9,
        reasoning={"effort": "low"},
    )
    row = chat_row("r", "hi", max_tokens=17, temperature=0.5, top_p=0.9, reasoning_effort="low")
    row["body"]["messages"].insert(0, {"role": "developer", "content": "be brief"})
    chat = parse_line(json.dumps(row), 1, CHAT)
    assert (got.messages, got.sampling, got.template_kwargs) == (
        chat.messages,
        chat.sampling,
        chat.template_kwargs,
    )
    assert got.limit_field == "max_output_tokens"


@pytest.mark.parametrize(
    ("body", "messages"),
    [
        ({"input": "hi"}, [{"role": "user", "content": "hi"}]),
        (
            {"input": "hi", "instructions": "be brief"},
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        ),
        (
            {
                "input": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "q"},
                    {
                        "type": "message",
                        "id": "msg_1",
                        "status": "completed",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "a", "annotations": []}],
                    },
                    {"role": "user", "content": [{"type": "input_text", "text": "q2"}]},
                ]
            },
            [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"},
            ],
        ),
        (
            {
                "input": [
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                    {"role": "user", "content": "why"},
                ]
            },
            [{"role": "assistant", "content": "no"}, {"role": "user", "content": "why"}],
        ),
    ],
)
def test_input_forms(body, messages):
    assert _parse(**body).messages == messages


@pytest.mark.parametrize(
    ("fmt", "guide"),
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, Guide.json_object()),
        (
            {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True, "description": "d"},
            Guide.json_schema(SCHEMA),
        ),
    ],
)
def test_text_format_is_the_structured_outputs_grammar(fmt, guide):
    request = _parse(text={"format": fmt, "verbosity": "low"})
    assert request.sampling.get("guide") == guide
    assert request.response_fields["text"] == {"format": fmt or {"type": "text"}, "verbosity": "low"}


IGNORED = {
    "store": False,
    "user": "u",
    "service_tier": "flex",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"},
    "stream": False,
    "stream_options": {"include_obfuscation": False},
    "truncation": "auto",
    "parallel_tool_calls": False,
    "tools": [],
    "tool_choice": "none",
    "max_tool_calls": 3,
    "include": [],
    "top_logprobs": 0,
    "background": False,
    "access_programs": {"cyber": "standard"},
    "metadata": {"team": "a"},
    "reasoning": {"context": "auto", "mode": "standard"},
}


@pytest.mark.parametrize("name", sorted(IGNORED))
def test_hints_are_accepted_and_change_nothing(name):
    request = _parse(**{name: IGNORED[name]})
    assert (request.messages, request.sampling, request.template_kwargs) == (
        [{"role": "user", "content": "hi"}],
        _parse().sampling,
        {},
    )


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
            "unsupported_parameter",
            "body.tools",
        ),
        ({"tool_choice": "required"}, "unsupported_parameter", "body.tool_choice"),
        ({"tool_choice": {"type": "web_search"}}, "unsupported_parameter", "body.tool_choice"),
        ({"include": ["message.output_text.logprobs"]}, "unsupported_parameter", "body.include"),
        ({"top_logprobs": 3}, "unsupported_parameter", "body.top_logprobs"),
        ({"background": True}, "unsupported_parameter", "body.background"),
        (
            {"background_options": {"completion_window": "2h"}},
            "unsupported_parameter",
            "body.background_options",
        ),
        ({"conversation": "conv_1"}, "unsupported_parameter", "body.conversation"),
        ({"previous_response_id": "resp_1"}, "unsupported_parameter", "body.previous_response_id"),
        ({"prompt": {"id": "pmpt_1"}}, "unsupported_parameter", "body.prompt"),
        (
            {"context_management": [{"type": "compaction"}]},
            "unsupported_parameter",
            "body.context_management",
        ),
        ({"image": {"detail": "high"}}, "unsupported_parameter", "body.image"),
        ({"moderation": {"model": "omni"}}, "unsupported_parameter", "body.moderation"),
        ({"stream": True}, "invalid_request", "body.stream"),
        ({"reasoning": {"summary": "auto"}}, "unsupported_parameter", "body.reasoning.summary"),
        (
            {"reasoning": {"generate_summary": "concise"}},
            "unsupported_parameter",
            "body.reasoning.generate_summary",
        ),
        ({"reasoning": {"mode": "pro"}}, "unsupported_parameter", "body.reasoning.mode"),
        ({"reasoning": {"effort": "extreme"}}, "invalid_parameter", "body.reasoning.effort"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
            "unsupported_parameter",
            "body.input[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-x"}]}]},
            "unsupported_parameter",
            "body.input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
            "invalid_input",
            "body.input[0].content[0]",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "invalid_input", "body.input[0].role"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "invalid_input", "body.input[0].name"),
        ({"input": [{"role": "user", "content": "x", "phase": 5}]}, "invalid_input", "body.input[0].phase"),
        (
            {"input": [{"role": "user", "content": "x", "status": "done"}]},
            "invalid_input",
            "body.input[0].status",
        ),
        ({"input": [{"role": "user", "content": "x", "id": 3}]}, "invalid_input", "body.input[0].id"),
        ({"input": [{"role": "user", "content": 5}]}, "invalid_input", "body.input[0].content"),
        (
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": "yes"}}},
            "invalid_parameter",
            "body.text.format.strict",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA, "description": 5}}},
            "invalid_parameter",
            "body.text.format.description",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": "{}"}}},
            "invalid_parameter",
            "body.text.format.schema",
        ),
        ({"text": {"format": {"type": "json_object", "name": "s"}}}, "invalid_parameter", "body.text.format"),
        ({"reasoning": {"context": "everything"}}, "invalid_parameter", "body.reasoning.context"),
        ({"reasoning": {"budget": 5}}, "invalid_parameter", "body.reasoning"),
        ({"input": []}, "invalid_input", "body.input"),
        ({"input": None}, "invalid_input", "body.input"),
        ({"input": ["hi"]}, "invalid_input", "body.input[0]"),
        ({"instructions": ["x"]}, "invalid_parameter", "body.instructions"),
        ({"max_output_tokens": -1}, "invalid_parameter", "body.max_output_tokens"),
        ({"max_output_tokens": 15}, "invalid_parameter", "body.max_output_tokens"),  # the spec's minimum: 16
        ({"max_output_tokens": 1.5}, "invalid_parameter", "body.max_output_tokens"),
        ({"temperature": 3}, "invalid_parameter", "body.temperature"),
        ({"top_p": "1"}, "invalid_parameter", "body.top_p"),
        ({"text": {"format": {"type": "grammar"}}}, "invalid_parameter", "body.text.format"),
        (
            {"text": {"format": {"type": "json_schema", "name": "bad name", "schema": SCHEMA}}},
            "invalid_parameter",
            "body.text.format.name",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "strnig"}}}},
            "invalid_parameter",
            "body.text.format",
        ),
        ({"text": {"verbosity": "loud"}}, "invalid_parameter", "body.text.verbosity"),
        ({"text": {"color": "red"}}, "invalid_parameter", "body.text"),
        ({"metadata": {"k": 1}}, "invalid_parameter", "body.metadata.k"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_parameter", "body.metadata"),
        ({"store": "yes"}, "invalid_parameter", "body.store"),
        ({"truncation": "middle"}, "invalid_parameter", "body.truncation"),
        ({"max_tool_calls": -1}, "invalid_parameter", "body.max_tool_calls"),
        ({"access_programs": "cyber"}, "invalid_parameter", "body.access_programs"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "unknown_parameter", "body.messages"),
        ({"max_tokens": 5}, "unknown_parameter", "body.max_tokens"),
    ],
)
def test_refused_fields_name_themselves(body, code, param):
    assert _refused(**body) == (code, param)


def _result(text: str, finish: str) -> dict:
    return {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "cached_tokens": 2,
        "metrics": {"arrival_time": 1.7e9},
        "finished_at": 1.7e9 + 1,
        "completions": [{"index": 0, "text": text, "finish_reason": finish}],
    }


@pytest.mark.parametrize(
    ("finish", "status", "details"),
    [("stop", "completed", None), ("length", "incomplete", "max_output_tokens")],
)
def test_the_output_body_is_an_sdk_response(finish, status, details):
    request = _parse(instructions="be brief", metadata={"team": "a"}, max_output_tokens=16, temperature=0)
    line = success_line(request, _result("Hello there", finish), MODEL)
    response = Response.model_validate(line["response"]["body"])
    assert response.output_text == "Hello there"
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")
    assert (response.status, response.output[0].status) == (status, status)
    assert (response.incomplete_details and response.incomplete_details.reason) == details
    assert (response.instructions, response.metadata, response.max_output_tokens, response.temperature) == (
        "be brief",
        {"team": "a"},
        16,
        0.0,
    )
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (5, 3, 8)
    assert (usage.input_tokens_details.cached_tokens, usage.output_tokens_details.reasoning_tokens) == (2, 0)


# JSON shaped like this API's values: their keys and the words they take.
_WORDS = [
    "type",
    "format",
    "json_schema",
    "json_object",
    "text",
    "name",
    "schema",
    "strict",
    "description",
    "effort",
    "summary",
    "mode",
    "role",
    "content",
    "input_text",
    "output_text",
    "user",
    "assistant",
    "message",
    "verbosity",
    "low",
    "phase",
    "status",
    "id",
]
RESPONSE_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(_WORDS),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_WORDS), inner, max_size=4),
    max_leaves=10,
)


@pytest.mark.parametrize("finish", ["stop", "length"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_json_value_in_any_field(finish, data):
    """The worker's path takes the line or refuses it naming the field; what it takes answers with a Response
    the openai package parses (every echoed field included)."""
    field = data.draw(st.sampled_from(sorted(BODY_FIELDS[RESPONSES] - {"model"})), label="field")
    value = data.draw(EDGES | JSON | RESPONSE_JSON, label="value")
    row = _row(max_output_tokens=16)
    row["body"][field] = value
    raw = json.dumps(row)
    run_like_a_worker(raw, RESPONSES, field)
    try:
        request = parse_line(raw, 1, RESPONSES)
    except LineError:
        return
    line = success_line(request, _result("x", finish), MODEL)
    assert Response.model_validate(line["response"]["body"]).output_text == "x"


def test_a_response_line_is_a_parquet_row():
    line = success_line(_parse(max_output_tokens=16), _result("Hello", "length"), MODEL)
    row = parquet_row(line)
    assert (
        row["status"],
        row["text"],
        row["finish_reason"],
        row["prompt_tokens"],
        row["completion_tokens"],
    ) == ("completed", "Hello", "length", 5, 3)


def test_a_watch_job_checks_responses_defaults(tmp_path):
    """A job for /v1/responses takes the Responses API's own fields as defaults and refuses chat's by name."""
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(
        "input: a\noutput: b\nendpoint: /v1/responses\ndefaults: {max_output_tokens: 16, temperature: 0}\n"
    )
    bad.write_text("input: a\noutput: b\nendpoint: /v1/responses\ndefaults: {max_tokens: 16}\n")
    assert Job.load(good).body_defaults() == {"max_output_tokens": 16, "temperature": 0}
    with pytest.raises(JobError, match="body.max_tokens"):
        Job.load(bad)


@pytest.mark.parametrize(
    ("body", "param"),
    [({"input": "word " * 40}, "body.input"), ({"max_output_tokens": 60}, "body.max_output_tokens")],
)
def test_what_does_not_fit_the_context_names_the_responses_field(body, param):
    request = _parse(**body)
    with pytest.raises(LineError) as info:
        fit_context(request, 80 if param == "body.input" else 10, 64)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", param)
