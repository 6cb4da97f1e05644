"""Decoding one input line into engine work (no server): what validates is exactly what runs."""

from __future__ import annotations

import json

import pytest

from bulkgen.batch.endpoints.completions import completion_body
from bulkgen.batch.prepare import fit_context
from bulkgen.batch.requests import COMPLETIONS, LineError, RequestLine, custom_id_of, parse_line
from tests.support.service import MODEL, chat_row, completion_row


def _line(row: dict) -> bytes:
    return json.dumps(row).encode()


def test_chat_fields_map_to_sampling_params():
    row = chat_row(
        "a",
        "hi",
        max_tokens=None,
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=2,
        seed=3,
        stop="END",
        logprobs=True,
        top_logprobs=3,
    )
    row["body"]["messages"] = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        },
        {"role": "user", "content": "hi"},
    ]
    request = parse_line(_line(row), 1, "/v1/chat/completions")
    assert request.messages[0] == {"role": "system", "content": "be brief"}
    assert request.sampling == {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "seed": 3,
        "stop": ["END"],
        "logprobs": 3,
    }


@pytest.mark.parametrize(
    ("change", "code", "param"),
    [
        ({"tools": [{"type": "function"}]}, "invalid_parameter", "body.tools[0]"),
        (
            {"tools": [{"type": "custom", "custom": {"name": "f"}}]},
            "unsupported_parameter",
            "body.tools[0].type",
        ),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "unsupported_parameter", "body.audio"),
        ({"presence_penalty": 2.5}, "invalid_parameter", "body.presence_penalty"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "strnig"}},
                }
            },
            "invalid_parameter",
            "body.response_format",
        ),
        ({"n": 129}, "invalid_parameter", "body.n"),
        ({"top_p": True}, "invalid_parameter", "body.top_p"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_parameter", "body.stop"),
        ({"top_logprobs": 2}, "invalid_parameter", "body.top_logprobs"),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            "invalid_messages",
            "body.messages[0].tool_call_id",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_messages", "body.messages[0]"),
    ],
)
def test_refused_fields_name_the_param(change, code, param):
    row = chat_row("a", "hi")
    row["body"].update(change)
    with pytest.raises(LineError) as info:
        parse_line(_line(row), 4, "/v1/chat/completions")
    assert (info.value.code, info.value.param) == (code, param)


def test_neutral_values_of_unsupported_fields_are_accepted():
    row = chat_row("a", "hi", presence_penalty=0, logit_bias={}, response_format={"type": "text"})
    assert parse_line(_line(row), 1, "/v1/chat/completions").custom_id == "a"


def test_completion_prompt_forms():
    assert parse_line(_line(completion_row("a", "text")), 1, COMPLETIONS).prompt == "text"
    assert parse_line(_line(completion_row("a", ["one"])), 1, COMPLETIONS).prompt == "one"
    row = completion_row("a", "x")
    row["body"]["prompt"] = [1, 2, 3]
    assert parse_line(_line(row), 1, COMPLETIONS).prompt == [1, 2, 3]
    row["body"]["prompt"] = ["two", "prompts"]
    assert parse_line(_line(row), 1, COMPLETIONS).prompts == ["two", "prompts"]
    row["body"]["prompt"] = [True]
    with pytest.raises(LineError, match="body.prompt must be"):
        parse_line(_line(row), 1, COMPLETIONS)


def test_fit_context_defaults_to_rest_of_context_and_refuses_overflow():
    request = parse_line(_line(completion_row("a", "x", max_tokens=None)), 1, COMPLETIONS)
    assert fit_context(request, prompt_len=10, max_model_len=50)["max_tokens"] == 40
    request.sampling["max_tokens"] = 41
    with pytest.raises(LineError) as info:
        fit_context(request, prompt_len=10, max_model_len=50)
    assert info.value.code == "context_length_exceeded" and "51 tokens" in info.value.message


def test_completion_logprobs_shape():
    result = {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "completions": [
            {
                "index": 0,
                "text": "ab",
                "finish_reason": "length",
                "logprobs": [
                    {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]},
                    {"token": "b", "logprob": -0.2, "top_logprobs": []},
                ],
            }
        ],
    }
    body = completion_body(result, "m")
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"a": -0.1}, {}],
        "text_offset": [0, 1],
    }
    assert body["usage"]["total_tokens"] == 4


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
def test_streamed_lines_keep_numbers_and_offsets_across_chunk_edges(monkeypatch, chunk):
    import io

    from bulkgen.batch import validate

    monkeypatch.setattr(validate, "READ_CHUNK", chunk)
    data = b'{"a": 1}\r\n\n' + b"x" * 20 + b"\nlast"
    got = list(validate.lines_with_offsets(io.BytesIO(data)))
    assert got == [(1, 0, b'{"a": 1}'), (2, 10, b""), (3, 11, b"x" * 20), (4, 32, b"last")]
    assert [data[start : start + len(raw)] for _, start, raw in got] == [raw for _, _, raw in got]


@pytest.mark.parametrize(
    ("field", "value"), [("top_p", -0.1), ("seed", 2**70), ("n", 0), ("temperature", -1)]
)
def test_the_parser_refuses_what_the_engine_refuses(field, value):
    from bulkgen.engine.sampling.sampling_params import SamplingError, SamplingParams

    with pytest.raises(SamplingError):
        SamplingParams(**{field: value})
    with pytest.raises(LineError) as parser:
        parse_line(_line(chat_row("a", "hi", **{field: value})), 1, "/v1/chat/completions")
    assert parser.value.param == f"body.{field}" and repr(value) in parser.value.message


def test_custom_id_length_and_unknown_fields():
    for custom_id in ("x" * 65, "x" * 1024, "é" * 512):  # no 64-character rule: 1,024 bytes of UTF-8
        assert parse_line(_line(chat_row(custom_id, "hi")), 1, "/v1/chat/completions").custom_id == custom_id
    for custom_id in ("x" * 1025, "é" * 512 + "x"):
        with pytest.raises(LineError) as info:
            parse_line(_line(chat_row(custom_id, "hi")), 1, "/v1/chat/completions")
        assert (info.value.code, info.value.param) == ("invalid_custom_id", "custom_id")
        assert "custom_id is 1025 bytes of UTF-8; at most 1024 are allowed" in info.value.message
    with pytest.raises(LineError) as info:
        parse_line(_line(chat_row("a", "hi", foo=1, bar=2)), 1, "/v1/chat/completions")
    assert info.value.param == "body.foo" and "body.foo, body.bar" in info.value.message
    assert parse_line(_line(chat_row("a", "hi", user="u")), 1, "/v1/chat/completions").custom_id == "a"


def test_a_request_line_keeps_its_fields_and_its_url_picks_the_body_parser():
    row = completion_row("a", "text")
    line = RequestLine.read(_line(row), 3, COMPLETIONS)
    assert (line.custom_id, line.method, line.url, line.line) == ("a", "POST", COMPLETIONS, 3)
    assert line.model == row["body"]["model"]
    request = line.request()
    assert (request.endpoint, request.prompt, request.line) == (COMPLETIONS, "text", 3)
    with pytest.raises(LineError) as info:  # a chat batch refuses a completions line: its url names its type
        RequestLine.read(_line(row), 3, "/v1/chat/completions")
    assert (info.value.code, info.value.param) == ("url_mismatch", "url")
    with pytest.raises(LineError) as info:
        RequestLine.read(_line({**row, "method": "GET"}), 3, COMPLETIONS)
    assert (info.value.code, info.value.param) == ("invalid_method", "method")


def test_custom_id_of_reads_the_id_alone_and_never_raises():
    assert custom_id_of(_line(completion_row("a", "x", temperature=99))) == "a"  # a refused body names it
    assert custom_id_of(b'{"custom_id": "r", "response": null, "error": {}}') == "r"  # a result line
    odd = (b"not json", b"[1]", b'{"custom_id": 5}', b"\xff")
    assert [custom_id_of(raw) for raw in odd] == ["", "", "", ""]


def test_a_files_endpoint_is_told_from_its_first_request_line():
    from bulkgen.batch.requests import url_of
    from bulkgen.cli.client import ClientError, endpoint_of

    assert url_of(b'{"custom_id": "a", "url": "/v1/embeddings"}') == "/v1/embeddings"
    assert url_of(b'{"custom_id": "a", "url": 3}') is None
    for raw in (b"[1, 2]", b"not json", b"\xff"):
        with pytest.raises(LineError):
            url_of(raw)
    assert endpoint_of([b"\n", b'{"url": "/v1/completions"}\n'], "f.jsonl") == "/v1/completions"
    with pytest.raises(ClientError, match=r"f.jsonl:2: not a JSON object"):
        endpoint_of([b"  \n", b"[]\n"], "f.jsonl")
    with pytest.raises(ClientError, match=r"f.jsonl:1: no 'url' field"):
        endpoint_of([b"{}\n"], "f.jsonl")
    with pytest.raises(ClientError, match="has no request lines"):
        endpoint_of([b"\n"], "f.jsonl")


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _deep_lines() -> dict[str, bytes]:
    """A 2 KB message content nested 990 levels, and a json_schema 500 objects deep (both spliced in as
    text: json.dumps itself would recurse that deep)."""
    chain = b'{"type": "string"}'
    for _ in range(500):
        chain = b'{"type": "object", "properties": {"a": ' + chain + b"}}"
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": "SCHEMA"}}
    return {
        "body.messages": _line(chat_row("deep-message", "TEXT")).replace(b'"TEXT"', _nested(990)),
        "body.response_format": _line(chat_row("deep-schema", "x", response_format=fmt)).replace(
            b'"SCHEMA"', chain
        ),
    }


def test_deep_nesting_refuses_its_line_naming_the_field():
    """Each its own line's 400, never a RecursionError; brackets inside strings do not count, and content
    nested right up to the limit is taken."""
    from bulkgen.batch.nesting import MAX_NESTING

    for param, raw in _deep_lines().items():
        with pytest.raises(LineError) as info:
            parse_line(raw, 4, "/v1/chat/completions")
        assert (info.value.code, info.value.param) == ("invalid_parameter", param)
        assert f"deeper than {MAX_NESTING} levels" in info.value.message and len(info.value.message) < 200
        assert custom_id_of(raw).startswith("deep-")
    # the line's object, body, messages and the message are 4 levels: content may take the rest
    at_limit = _line(chat_row("fits", "TEXT")).replace(b'"TEXT"', _nested(MAX_NESTING - 4))
    assert RequestLine.read(at_limit, 1, "/v1/chat/completions").too_deep is None
    over = _line(chat_row("over", "TEXT")).replace(b'"TEXT"', _nested(MAX_NESTING - 3))
    assert RequestLine.read(over, 1, "/v1/chat/completions").too_deep == "messages"
    in_text = chat_row("text", "[" * 5000 + "{" * 5000)  # brackets in a string are text
    assert parse_line(_line(in_text), 1, "/v1/chat/completions").messages[0]["content"].startswith("[[[")


def test_a_file_with_deep_lines_refuses_them_alone_by_number():
    import io

    from bulkgen.batch.validate import Validator, validate_stream

    deep = _deep_lines()
    rows = [deep["body.messages"], _line(chat_row("ok", "hi")), deep["body.response_format"]]
    result = validate_stream(io.BytesIO(b"\n".join(rows)), Validator("/v1/chat/completions", [MODEL], 10))
    assert result.ok and result.total == 3
    assert [(r["line"], r["param"]) for r in result.refused] == [
        (1, "body.messages"),
        (3, "body.response_format"),
    ]
