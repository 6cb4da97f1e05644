"""The values the spec-compatibility corpus tries, per field: (field, label, body change, refused param or None).

Values are the spec's limits, defaults, null and each enum member, plus the shapes a field takes. Refusals are
exactly README's list: features a text-only self-hosted model cannot honour, and a max_tokens beyond the context.
"""

from __future__ import annotations

from tests.support.service import TOOLS_MODEL

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL = {"type": "function", "function": WEATHER}
TOOLS = {"tools": [TOOL]}
USER = {"role": "user", "content": "Say hi"}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}


def base_body(endpoint: str) -> dict:
    if endpoint == CHAT:
        return {"model": TOOLS_MODEL, "messages": [USER], "max_tokens": 2}
    return {"model": TOOLS_MODEL, "prompt": "Once upon", "max_tokens": 2}


def _messages(label: str, *messages: dict, refused: str | None = None) -> tuple:
    return ("messages", label, {"messages": list(messages)}, refused)


def _values(field: str, *values, extra: dict | None = None) -> list[tuple]:
    """One runnable case per value (labels: the value as JSON text)."""
    return [
        (field, "null" if v is None else str(v).lower().replace(" ", ""), {field: v, **(extra or {})}, None)
        for v in values
    ]


def _part(kind: str, part: dict) -> tuple:
    return _messages(
        f"{kind}-part",
        {"role": "user", "content": [{"type": "text", "text": "see"}, part]},
        refused="body.messages[0].content[1].type",
    )


_SAMPLING = [
    *_values("temperature", 0, 1, 2, None),
    *_values("top_p", 0, 0.5, 1, None),
    *_values("n", 1, 128, None),
    *_values("seed", -(2**63), 0, 2**63 - 1, None),
    *_values("frequency_penalty", -2, 0, 2, None),
    *_values("presence_penalty", -2, 0, 2, None),
    *_values("user", "user-1"),
    ("stop", "string", {"stop": "\n"}, None),
    ("stop", "four", {"stop": ["a", "b", "c", "d"]}, None),
    ("stop", "null", {"stop": None}, None),
    ("logit_bias", "ban", {"logit_bias": {"65": -100}}, None),
    ("logit_bias", "boost", {"logit_bias": {"65": 100, "66": 5}}, None),
    ("logit_bias", "null", {"logit_bias": None}, None),
    ("stream", "false", {"stream": False}, None),
    ("stream", "null", {"stream": None}, None),
    ("stream", "true", {"stream": True}, "body.stream"),
    ("stream_options", "usage", {"stream_options": {"include_usage": True}}, None),
    ("stream_options", "null", {"stream_options": None}, None),
    ("model", "served", {}, None),
]

CASES: dict[str, list[tuple]] = {
    CHAT: [
        *_SAMPLING,
        _messages("string", USER),
        _messages("text-parts", {"role": "user", "content": [{"type": "text", "text": "hi"}]}),
        _messages("system", {"role": "system", "content": "Be brief."}, USER),
        _messages(
            "developer", {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, USER
        ),
        _messages("names", {"role": "user", "content": "hi", "name": "ann"}),
        _messages("refusal", USER, {"role": "assistant", "content": None, "refusal": "I cannot."}, USER),
        _messages(
            "assistant-parts",
            USER,
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Hi."}, {"type": "refusal", "refusal": "No."}],
            },
            USER,
        ),
        _messages(
            "tool-calls",
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ),
        _messages(
            "function-call",
            USER,
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "get_weather", "arguments": "{}"},
            },
            {"role": "function", "name": "get_weather", "content": "sunny"},
        ),
        _part("image", {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
        _part("audio", {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
        _part("file", {"type": "file", "file": {"file_id": "file-abc"}}),
        *_values("max_tokens", 0, 5, None),
        *_values("max_completion_tokens", 0, 5, None, extra={"max_tokens": None}),
        ("max_tokens", "beyond-context", {"max_tokens": 2**63}, "body.max_tokens"),
        ("logprobs", "true", {"logprobs": True}, None),
        *_values("logprobs", False, None),
        *_values("top_logprobs", 0, 20, extra={"logprobs": True}),
        *_values("store", True, False, None),
        ("metadata", "pairs", {"metadata": {"team": "a"}}, None),
        *_values("metadata", None),
        *_values("service_tier", "auto", "default", "flex", "scale", "priority", "fast", None),
        *_values("safety_identifier", "sid-1", None),
        *_values("prompt_cache_key", "key-1", None),
        *_values("prompt_cache_retention", "in_memory", "24h", None),
        ("prompt_cache_options", "empty", {"prompt_cache_options": {}}, None),
        ("modalities", "text", {"modalities": ["text"]}, None),
        *_values("modalities", None),
        ("modalities", "audio", {"modalities": ["text", "audio"]}, "body.modalities"),
        *_values("verbosity", "low", "medium", "high", None),
        *_values("reasoning_effort", "none", "minimal", "low", "medium", "high", "xhigh", "max", None),
        ("prediction", "content", {"prediction": {"type": "content", "content": "Hello"}}, None),
        *_values("prediction", None),
        ("response_format", "text", {"response_format": {"type": "text"}}, None),
        (
            "response_format",
            "json-object",
            {"response_format": {"type": "json_object"}},
            None,
        ),
        (
            "response_format",
            "json-schema",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            None,
        ),
        (
            "audio",
            "wav",
            {"modalities": ["text"], "audio": {"voice": "alloy", "format": "wav"}},
            "body.audio",
        ),
        *_values("audio", None),
        ("web_search_options", "default", {"web_search_options": {}}, "body.web_search_options"),
        ("moderation", "model", {"moderation": {"model": "omni-moderation-latest"}}, "body.moderation"),
        *_values("moderation", None),
        ("tools", "function", TOOLS, None),
        (
            "tools",
            "custom",
            {"tools": [{"type": "custom", "custom": {"name": "shell"}}]},
            "body.tools[0].type",
        ),
        ("tool_choice", "none", {**TOOLS, "tool_choice": "none"}, None),
        ("tool_choice", "auto", {**TOOLS, "tool_choice": "auto"}, None),
        (
            "tool_choice",
            "allowed-auto",
            {
                **TOOLS,
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {
                        "mode": "auto",
                        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
                    },
                },
            },
            None,
        ),
        ("tool_choice", "required", {**TOOLS, "tool_choice": "required"}, None),
        (
            "tool_choice",
            "named",
            {**TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            None,
        ),
        *_values("parallel_tool_calls", True, False, extra=TOOLS),
        ("functions", "one", {"functions": [WEATHER]}, None),
        ("function_call", "none", {"functions": [WEATHER], "function_call": "none"}, None),
        ("function_call", "auto", {"functions": [WEATHER], "function_call": "auto"}, None),
        (
            "function_call",
            "named",
            {"functions": [WEATHER], "function_call": {"name": "get_weather"}},
            None,
        ),
    ],
    COMPLETIONS: [
        *_SAMPLING,
        ("prompt", "string", {"prompt": "Once upon"}, None),
        ("prompt", "empty", {"prompt": ""}, None),
        ("prompt", "null", {"prompt": None}, None),
        ("prompt", "one-string", {"prompt": ["Once upon"]}, None),
        ("prompt", "tokens", {"prompt": [79, 110, 99, 101]}, None),
        ("prompt", "one-token-list", {"prompt": [[79, 110]]}, None),
        ("prompt", "strings", {"prompt": ["Once", "upon"]}, None),
        ("prompt", "token-lists", {"prompt": [[79], [110]]}, None),
        ("prompt", "strings-n2-echo", {"prompt": ["Once", "upon", "zebra"], "n": 2, "echo": True}, None),
        *_values("max_tokens", 0, 16, None),
        *_values("best_of", 1, 2, 20, None),
        *_values("echo", True, False, None),
        ("echo", "logprobs", {"echo": True, "logprobs": 2}, None),
        *_values("logprobs", 0, 5, None),
        ("suffix", "text", {"suffix": " the end"}, "body.suffix"),
        *_values("suffix", None),
    ],
}
