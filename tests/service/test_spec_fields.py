"""The spec's request fields, one by one (no server): null is the default, no value overflows, hints are
accepted and ignored, what cannot be honoured is refused by name, and a body error refuses one line only."""

from __future__ import annotations

import io
import json

import pytest

from bulkgen.batch.endpoints.completions import completion_body, merge_results
from bulkgen.batch.prepare import fit_context, split_prompts
from bulkgen.batch.requests import CHAT, COMPLETIONS, LineError, parse_line
from bulkgen.batch.validate import Validator, validate_stream
from bulkgen.runtime.lineindex import IndexBuilder
from tests.support.service import MODEL, chat_row, completion_row

IGNORED = {
    "store": False,
    "metadata": {"team": "a"},
    "service_tier": "flex",
    "safety_identifier": "u-1",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"},
    "user": "u",
    "stream_options": {"include_usage": True},
    "modalities": ["text"],
    "prediction": {"type": "content", "content": "x"},
    "verbosity": "low",
    "parallel_tool_calls": False,
    "function_call": "auto",
    "tool_choice": "none",
    "stream": False,
    "response_format": {"type": "text"},
}


def _chat(**body):
    return parse_line(json.dumps(chat_row("a", "hi", **body)), 1, CHAT)


def _completion(**body):
    row = completion_row("a", "hi")
    row["body"].update(body)
    return parse_line(json.dumps(row), 1, COMPLETIONS)


def _refused(parse, **body) -> tuple[str, str]:
    with pytest.raises(LineError) as info:
        parse(**body)
    return info.value.code, info.value.param


def test_null_means_default_for_every_nullable_field():
    nulls = dict.fromkeys(
        [
            "top_p",
            "n",
            "seed",
            "stop",
            "logprobs",
            "top_logprobs",
            "max_completion_tokens",
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
            *IGNORED,
            "tools",
            "functions",
            "audio",
            "web_search_options",
            "reasoning_effort",
        ]
    )
    assert (
        _chat(**nulls).sampling
        == _chat().sampling
        == {
            "max_tokens": 8,
            "temperature": 0.0,
            "n": 1,
            "seed": None,
            "stop": None,
            "logprobs": None,
        }
    )
    assert "temperature" not in _chat(temperature=None).sampling  # the model's default, else OpenAI's 1
    plain = _completion(**dict.fromkeys(["best_of", "echo", "suffix", "logprobs", "max_tokens"]))
    assert plain.sampling["max_tokens"] is None and plain.echo is False


def test_service_hints_are_accepted_and_ignored():
    assert _chat(**IGNORED).sampling == _chat().sampling


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream": True}, "body.stream"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "body.audio"),
        ({"web_search_options": {}}, "body.web_search_options"),
        ({"modalities": ["text", "audio"]}, "body.modalities"),
        ({"response_format": {"type": "xml"}}, "body.response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}},
                }
            },
            "body.response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x y"}}},
            "body.response_format.json_schema.name",
        ),
        ({"tool_choice": "required"}, "body.tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "body.tool_choice"),
        ({"function_call": {"name": "f"}}, "body.function_call"),
        ({"moderation": {"model": "m"}}, "body.moderation"),
        ({"store": "yes"}, "body.store"),
        ({"metadata": [1]}, "body.metadata"),
        ({"user": 5}, "body.user"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(body, param):
    assert _refused(_chat, **body)[1] == param


def test_audio_and_file_parts_are_refused_naming_the_part():
    """Image parts parse (tests/images); the other media parts are refused by name."""
    row = chat_row("a", "hi")
    row["body"]["messages"][0]["content"] = [
        {"type": "text", "text": "listen"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ]
    with pytest.raises(LineError) as info:
        parse_line(json.dumps(row), 1, CHAT)
    assert (info.value.code, info.value.param) == (
        "unsupported_parameter",
        "body.messages[0].content[1].type",
    )
    assert info.value.message.startswith("body.messages[0].content[1] is an input_audio part;")
    row["body"]["messages"][0]["content"][1] = {"type": "file", "file": {"file_id": "file-1"}}
    with pytest.raises(LineError, match=r"content\[1\] is a file part;"):
        parse_line(json.dumps(row), 1, CHAT)


def test_message_fields_are_the_spec_role_by_role():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    conversation = [
        {"role": "developer", "content": "d", "name": "ops"},
        {"role": "user", "content": "u", "name": "ann"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call], "audio": None},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert len(_chat(messages=conversation).messages) == 4
    for message, key in [
        ({"role": "user", "content": "u", "tool_call_id": "c1"}, "tool_call_id"),
        ({"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"}, "name"),
        ({"role": "system", "content": "s", "refusal": "no"}, "refusal"),
        ({"role": "assistant", "content": "a", "reasoning_content": "hmm"}, "reasoning_content"),
        ({"role": "user", "content": "u", "cache_control": {"type": "ephemeral"}}, "cache_control"),
    ]:
        with pytest.raises(LineError) as info:
            _chat(messages=[message])
        assert (info.value.code, info.value.param) == ("unknown_parameter", f"body.messages[0].{key}")
        assert f"body.messages[0].{key} is not a field of a {message['role']} message" in info.value.message
    audio = {"role": "assistant", "content": None, "audio": {"id": "audio_1"}}
    assert _refused(_chat, messages=[audio]) == ("unsupported_parameter", "body.messages[0].audio")
    assert _refused(_chat, messages=[{"role": ["user"], "content": "u"}]) == (
        "invalid_messages",
        "body.messages[0]",
    )


def test_completion_refusals_and_prompt_forms():
    assert _refused(_completion, suffix="end")[1] == "body.suffix"
    assert _completion(suffix="").prompt == "hi"
    assert _refused(_completion, best_of=1, n=2) == ("invalid_parameter", "body.best_of")
    several = _completion(prompt=["a", [5, 6], "c"])
    assert (several.prompt, several.prompts) == ("a", ["a", [5, 6], "c"])
    assert [r.prompt for r in split_prompts(several)] == ["a", [5, 6], "c"]
    assert _refused(_completion, prompt=["x"] * 129) == ("invalid_parameter", "body.prompt")
    assert _refused(_completion, prompt=["a", [-1]]) == ("invalid_prompt", "body.prompt")
    assert _completion(prompt="").prompt == "" and _completion(prompt=None).prompt == ""
    assert _completion(prompt=[[5, 6]]).prompt == [5, 6]


def test_honoured_values_become_sampling_params():
    request = _chat(n=128, frequency_penalty=-2, presence_penalty=1.5, logit_bias={"7": -100, "42": 12})
    assert request.sampling["n"] == 128
    assert (request.sampling["frequency_penalty"], request.sampling["presence_penalty"]) == (-2.0, 1.5)
    assert request.sampling["logit_bias"] == {7: -100.0, 42: 12.0}
    assert "presence_penalty" not in _chat(presence_penalty=0).sampling  # neutral: the engine pays nothing
    assert _refused(_chat, logit_bias={"abc": 1})[1] == "body.logit_bias"
    assert _refused(_chat, logit_bias={"1": 101})[1] == "body.logit_bias"
    assert _refused(_chat, seed=2**63) == ("invalid_parameter", "body.seed")
    assert _refused(_chat, n=129)[1] == "body.n"
    echo = _completion(echo=True, logprobs=2, best_of=3)
    assert echo.echo and echo.sampling["prompt_logprobs"] == 2 and echo.sampling["best_of"] == 3
    assert "best_of" not in _completion(best_of=1).sampling


def test_huge_max_tokens_never_overflow_validation_or_the_index():
    for body in ({"max_tokens": 2**63}, {"max_tokens": 2**62, "n": 128}, {"max_tokens": 10**30, "n": 4}):
        request = _chat(**body)
        builder = IndexBuilder()
        builder.add(1, 0, b"{}", request)
        assert builder.build().work[0] > 0
        with pytest.raises(LineError) as info:
            fit_context(request, prompt_len=10, max_model_len=4096)
        assert (info.value.code, info.value.param) == ("context_length_exceeded", "body.max_tokens")
    with pytest.raises(LineError) as info:
        fit_context(_chat(max_tokens=None, max_completion_tokens=5000), prompt_len=10, max_model_len=4096)
    assert info.value.param == "body.max_completion_tokens"
    with pytest.raises(LineError) as info:
        fit_context(_chat(), prompt_len=4096, max_model_len=4096)
    assert info.value.param == "body.messages"


def _file(rows: list) -> io.BytesIO:
    return io.BytesIO("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode())


def test_a_body_error_refuses_its_line_and_keeps_it_in_the_index():
    rows = [
        chat_row("a", "hi"),
        chat_row("b", "hi", temperature=7),
        chat_row("c", "hi", tool_choice="required"),
    ]
    builder = IndexBuilder()
    result = validate_stream(_file(rows), Validator(CHAT, [MODEL], 100), builder.add)
    assert result.ok and result.total == 3 and result.refused_count == 2
    assert [(e["line"], e["param"]) for e in result.refused] == [
        (2, "body.temperature"),
        (3, "body.tool_choice"),
    ]
    assert list(builder.build().lines) == [
        1,
        2,
        3,
    ]  # the runner cuts ranges over every line; workers refuse 2, 3


def test_a_file_error_fails_the_file_and_lists_the_body_errors_too():
    rows = [chat_row("a", "hi", temperature=7), chat_row("a", "hi"), {**chat_row("c", "hi"), "url": "/v1/x"}]
    result = validate_stream(_file(rows), Validator(CHAT, [MODEL], 100))
    assert not result.ok
    listed = [(e["line"], e["code"]) for e in result.error_list()["data"]]
    assert listed == [(1, "invalid_parameter"), (2, "duplicate_custom_id"), (3, "url_mismatch")]


def test_echo_leads_text_and_logprobs_with_the_prompt():
    result = {
        "prompt_tokens": 2,
        "completion_tokens": 1,
        "cached_tokens": 0,
        "completions": [
            {
                "index": 0,
                "text": "c",
                "finish_reason": "length",
                "echo": {"text": "ab", "first_token": "a"},
                "prompt_logprobs": [
                    {"token": "b", "logprob": -1.0, "top_logprobs": [{"token": "b", "logprob": -1.0}]}
                ],
                "logprobs": [{"token": "c", "logprob": -0.5, "top_logprobs": []}],
            }
        ],
    }
    choice = completion_body(result, "m")["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [None, -1.0, -0.5],
        "top_logprobs": [None, {"b": -1.0}, {}],
        "text_offset": [0, 1, 2],
    }


def test_several_prompts_number_their_choices_across_prompts():
    def result(tag: str, tokens: int) -> dict:
        return {
            "prompt_tokens": tokens,
            "completion_tokens": 2,
            "cached_tokens": 1,
            "completions": [
                {"index": i, "text": f"{tag}{i}", "finish_reason": "length", "logprobs": None}
                for i in range(2)
            ],
        }

    merged = merge_results([result("a", 3), result("b", 4), result("c", 5)], n=2)
    assert [(c["index"], c["text"]) for c in merged["completions"]] == [
        (0, "a0"),
        (1, "a1"),
        (2, "b0"),
        (3, "b1"),
        (4, "c0"),
        (5, "c1"),
    ]
    assert (merged["prompt_tokens"], merged["completion_tokens"], merged["cached_tokens"]) == (12, 6, 3)


@pytest.mark.parametrize("parse", [_chat, _completion])
def test_vllm_sampling_extensions_are_accepted_and_checked(parse):
    """top_k, min_p, repetition_penalty: vLLM's extensions, not OpenAI fields, honoured on both endpoints."""
    request = parse(top_k=40, min_p=0.05, repetition_penalty=1.2)
    assert (request.sampling["top_k"], request.sampling["min_p"]) == (40, 0.05)
    assert request.sampling["repetition_penalty"] == 1.2
    # set, even to "off", it stays in the kwargs: the line's choice beats the model's generation_config default
    for off, kwargs in [
        ({"top_k": -1}, {"top_k": 0}),
        ({"top_k": 0}, {"top_k": 0}),
        ({"min_p": 0}, {"min_p": 0.0}),
        ({"repetition_penalty": 1}, {"repetition_penalty": 1.0}),
        ({"temperature": 1}, {"temperature": 1.0}),
    ]:
        assert parse(**off).sampling.items() >= kwargs.items()
    unset = set(parse(top_k=None, temperature=None).sampling)  # null or absent: the model's default applies
    assert not {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"} & unset
    for name, bad in [
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("min_p", 1.01),
        ("min_p", -0.1),
        ("min_p", "0.1"),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
    ]:
        assert _refused(parse, **{name: bad}) == ("invalid_parameter", f"body.{name}"), (name, bad)
    assert _refused(parse, top_n=3) == ("unknown_parameter", "body.top_n")
