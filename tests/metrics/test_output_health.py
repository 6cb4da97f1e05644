"""Output health: each problem read from the answer body bulkgen writes (the real parser of the line, the
real writer of its output line), and the batch's counts bounded, mergeable and kept across a resume."""

from __future__ import annotations

import json

import pytest

from bulkgen.batch.health import line_problems
from bulkgen.batch.outputlines import success_line
from bulkgen.batch.requests import CHAT, COMPLETIONS, RESPONSES, parse_line
from bulkgen.metrics import BatchMetrics
from bulkgen.metrics.health import CHECKS, SAMPLES, OutputHealth
from bulkgen.metrics.table import describe_summary

MODEL = "m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


def _request(url: str = CHAT, tool_format: str | None = None, **body):
    if url == COMPLETIONS:
        base = {"model": MODEL, "prompt": "hi"}
    elif url == RESPONSES:
        base = {"model": MODEL, "input": "hi"}
    else:
        base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    row = {"custom_id": "line-1", "method": "POST", "url": url, "body": {**base, **body}}
    request = parse_line(json.dumps(row), 1, url)
    request.tool_format = tool_format  # what prepare reads from the chat template
    return request


def _problems(request, *completions: dict) -> tuple[list, set]:
    """The problems of the body bulkgen writes for `completions` (each: text, finish_reason and, for a
    reasoning model, the content and reasoning the reasoning parser split it into)."""
    result = {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "cached_tokens": 0,
        "metrics": {"arrival_time": 1.7e9},
        "finished_at": 1.7e9 + 1,
        "completions": [{"index": i, "finish_reason": "stop", **c} for i, c in enumerate(completions)],
    }
    body = success_line(request, result, MODEL)["response"]["body"]
    return line_problems(request, body)


def test_a_good_answer_has_no_problem_and_its_finish_reasons_count():
    reasons, problems = _problems(
        _request(n=2), {"text": "Blue light."}, {"text": "Cut", "finish_reason": "length"}
    )
    assert (reasons, problems) == (["stop", "length"], set())


@pytest.mark.parametrize("text", ["", "  \n "])
def test_blank_content_is_an_empty_answer(text):
    assert _problems(_request(), {"text": text})[1] == {"empty_answer"}
    assert _problems(_request(COMPLETIONS), {"text": text})[1] == {"empty_answer"}


def test_reasoning_cut_before_its_answer():
    cut = {"text": "<think>long", "content": None, "reasoning": "long", "finish_reason": "length"}
    assert _problems(_request(), cut) == (["length"], {"reasoning_without_answer"})
    assert _problems(_request(RESPONSES), cut) == (["length"], {"reasoning_without_answer"})
    answered = {"text": "x", "content": "Blue.", "reasoning": "long"}
    assert _problems(_request(RESPONSES), answered)[1] == set()


def test_one_bad_choice_of_several_makes_the_line_count_once():
    request = _request(n=3)
    reasons, problems = _problems(request, {"text": "ok"}, {"text": ""}, {"text": ""})
    assert reasons == ["stop"] * 3 and problems == {"empty_answer"}


@pytest.mark.parametrize(
    ("text", "failed"),
    [('{"a": 1}', False), ('{"a": "one"}', True), ('{"b": 1}', True), ('{"a": 1', True), ("[]", True)],
)
def test_content_that_fails_its_schema(text, failed):
    assert ("schema_failed" in _problems(_request(response_format=SCHEMA), {"text": text})[1]) is failed
    as_text = {"format": {"type": "json_schema", **SCHEMA["json_schema"]}}
    assert ("schema_failed" in _problems(_request(RESPONSES, text=as_text), {"text": text})[1]) is failed


def test_json_object_wants_an_object():
    request = _request(response_format={"type": "json_object"})
    assert _problems(request, {"text": '{"x": [1]}'})[1] == set()
    assert _problems(request, {"text": '"just a string"'})[1] == {"schema_failed"}


def test_a_call_that_did_not_parse_stays_content_and_is_counted():
    request = _request(tools=[WEATHER], tool_format="hermes")
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reasons, problems = _problems(request, {"text": good})
    assert (reasons, problems) == (["tool_calls"], set())  # parsed: tool_calls, not content
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert _problems(request, {"text": broken}) == (["stop"], {"tool_call_unparsed"})
    assert _problems(request, {"text": "It is sunny."})[1] == set()  # no call begun: a plain answer
    no_tools = _request(tool_format="hermes")  # a line without tools: markup is just text
    assert _problems(no_tools, {"text": broken})[1] == set()


def test_mistral_marker_without_a_readable_call():
    request = _request(tools=[WEATHER], tool_format="mistral")
    assert _problems(request, {"text": '[TOOL_CALLS][{"name": "get_weather", "argu'})[1] == {
        "tool_call_unparsed"
    }


def test_counts_keep_ten_ids_merge_and_survive_a_resume():
    health = OutputHealth()
    for i in range(25):
        health.add(f"e{i}", ["stop"], ["empty_answer"] if i % 2 else [])
    other = OutputHealth()
    other.add("s0", ["length", "length"], ["schema_failed", "schema_failed"])
    health.merge(other.to_state())
    summary = health.summary()
    assert summary["answers"] == 26
    assert summary["finish_reasons"] == {"length": 2, "stop": 25}
    assert summary["empty_answer"] == {"count": 12, "custom_ids": [f"e{i}" for i in range(1, 21, 2)]}
    assert len(summary["empty_answer"]["custom_ids"]) == SAMPLES
    assert summary["schema_failed"] == {"count": 1, "custom_ids": ["s0"]}
    assert set(CHECKS) <= set(summary)
    with pytest.raises(ValueError, match="unknown output health check"):
        health.add("x", [], ["slow"])

    metrics = BatchMetrics()
    metrics.add_request({"num_prompt_tokens": 3, "num_output_tokens": 2})
    metrics.health.merge(health.to_state())
    resumed = BatchMetrics.from_state(json.loads(json.dumps(metrics.to_state())))
    assert resumed.summary()["output_health"] == summary
    table = describe_summary(resumed.summary())
    assert "empty answer" in table and "12 (e1, e3, e5, ...)" in table and "length 2, stop 25" in table


def test_a_state_stored_before_health_resumes_empty():
    state = BatchMetrics().to_state()
    del state["health"]
    assert BatchMetrics.from_state(state).summary()["output_health"]["answers"] == 0
