"""Tool calls: read out of model text in the three template families' formats, answered in the API's shape,
and tool definitions rendered through the model's own chat template (no server)."""

from __future__ import annotations

import json

import pytest

from bulkgen.batch.endpoints.chat import chat_body
from bulkgen.batch.prepare import render_chat, tokenize
from bulkgen.batch.requests import CHAT, LineError, parse_line
from bulkgen.batch.tools import parse_tool_calls, tool_format
from bulkgen.lab.tiny import build_tokenizer
from tests.support.service import HERMES_TEMPLATE, chat_row

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


def test_hermes_calls_with_text_before():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me check."
    assert [(c["function"]["name"], _args(c)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_hermes_call_cut_short_by_max_tokens_is_still_read_when_its_json_is_whole():
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}', "hermes")
    assert content is None and [c["function"]["name"] for c in calls] == ["f"]


def test_llama3_json_with_and_without_python_tag():
    for text in (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    ):
        content, calls = parse_tool_calls(text, "llama3")
        assert content is None and _args(calls[0]) == {"city": "Oslo"}
    _, calls = parse_tool_calls(
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "llama3"
    )
    assert [c["function"]["name"] for c in calls] == ["a", "b"]


def test_mistral_tool_calls_list():
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "now", "arguments": {}}]'
    content, calls = parse_tool_calls(text, "mistral")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert calls[1]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        ("Just an answer.", "hermes"),
        ("<tool_call>not json</tool_call>", "hermes"),
        ('{"city": "Paris"}', "llama3"),
        ("The answer is 4.", "llama3"),
        ("[TOOL_CALLS] oops", "mistral"),
        ('<tool_call>{"arguments": {}}</tool_call>', "hermes"),
    ],
)
def test_text_that_is_no_call_stays_content(text, fmt):
    assert parse_tool_calls(text, fmt) == (text, [])


def test_the_format_comes_from_the_template_source():
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert (
        tool_format("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}{% endif %}[TOOL_CALLS]") == "mistral"
    )
    assert tool_format('{% if tools %}<|python_tag|>{"name": .., "parameters": ..}{% endif %}') == "llama3"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format(None) is None


def test_chat_body_answers_tool_calls_and_legacy_function_call():
    result = {
        "prompt_tokens": 3,
        "completion_tokens": 9,
        "cached_tokens": 0,
        "completions": [
            {
                "index": 0,
                "text": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
                "finish_reason": "stop",
                "logprobs": None,
            },
            {"index": 1, "text": "No tool needed.", "finish_reason": "stop", "logprobs": None},
        ],
    }
    first, second = chat_body(result, "m", "hermes")["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert _args(first["message"]["tool_calls"][0]) == {"city": "Paris"}
    assert second["finish_reason"] == "stop" and second["message"] == {
        "role": "assistant",
        "content": "No tool needed.",
        "refusal": None,
    }
    legacy = chat_body(result, "m", "hermes", legacy=True)["choices"][0]
    assert legacy["finish_reason"] == "function_call" and "tool_calls" not in legacy["message"]
    assert legacy["message"]["function_call"]["name"] == "get_weather"
    plain = chat_body(result, "m", None)["choices"][0]  # tools not rendered: the text is the answer
    assert plain["finish_reason"] == "stop" and plain["message"]["content"].startswith("<tool_call>")


def _tokenizer(template: str):
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def _request(**body):
    row = chat_row("a", "What is the weather in Paris?", **body)
    return parse_line(json.dumps(row), 1, CHAT)


def test_tools_and_a_replayed_tool_conversation_render_through_the_template():
    request = _request(tools=[WEATHER], reasoning_effort="low")
    request.messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    text = render_chat(request, _tokenizer(HERMES_TEMPLATE))
    assert json.dumps(WEATHER) in text and "effort: low" in text and request.tool_format == "hermes"
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|tool|>sunny, 21C" in text


def test_messages_keep_name_refusal_tool_calls_and_tool_results():
    row = chat_row("a", "hi")
    row["body"]["messages"] = [
        {"role": "developer", "content": "be brief", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}], "name": "ann"},
        {"role": "assistant", "content": None, "refusal": "I cannot."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": [{"type": "text", "text": "rain"}]},
        {"role": "function", "name": "get_weather", "content": "rain"},
    ]
    messages = parse_line(json.dumps(row), 1, CHAT).messages
    assert messages[0] == {"role": "system", "content": "be brief", "name": "ops"}
    assert messages[2]["content"] == "I cannot."
    assert messages[3]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object, for tojson
    assert messages[4] == {"role": "tool", "content": "rain", "tool_call_id": "call_9"}
    assert messages[5] == {"role": "function", "content": "rain", "name": "get_weather"}


def test_a_template_that_ignores_tools_refuses_them_rather_than_drop_them():
    tok = _tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(LineError) as info:
        tokenize(_request(tools=[WEATHER]), tok)
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "body.tools")
    with pytest.raises(LineError) as info:
        tokenize(_request(functions=[WEATHER["function"]]), tok)
    assert info.value.param == "body.functions"
    assert tokenize(_request(tools=[WEATHER], tool_choice="none"), tok)  # "none": tools are not rendered


def test_reasoning_effort_goes_only_to_templates_that_take_it():
    plain = _tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert render_chat(_request(reasoning_effort="high"), plain) == "What is the weather in Paris?"


def test_an_answer_of_tool_calls_summarises_as_its_calls():
    """Previews (`bulkgen run`) and Parquet rows show a call answer (content null) as its calls."""
    from bulkgen.batch.outputlines import answer_summary

    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    result = {
        "prompt_tokens": 3,
        "completion_tokens": 9,
        "cached_tokens": 0,
        "completions": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
    }
    assert answer_summary(chat_body(result, "m", "hermes"))["text"] == 'get_weather({"city": "Paris"})'
    legacy = answer_summary(chat_body(result, "m", "hermes", legacy=True))
    assert legacy["text"] == 'get_weather({"city": "Paris"})' and legacy["finish_reason"] == "function_call"
