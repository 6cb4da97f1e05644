"""Forced tool calls (`tool_choice` required or named) written in each family's own call syntax: on a tiny
random model (which writes no call by itself; its byte-level tokenizer spells each marker byte by byte) under the grammar bulkgen builds for that format, every
output that finishes is read back by the format's reader as one call of the forced tool, with arguments
valid for its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bulkgen.batch.structured import REQUIRED
from bulkgen.batch.tools import WRITERS, forced_guide, parse_tool_calls
from bulkgen.engine import Engine, SamplingParams
from tests.support.service import random_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "metric": {"type": "boolean"},
                "note": {"type": "string", "maxLength": 6},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, NOW)}


@pytest.fixture(scope="module")
def tiny():
    return Engine.from_pretrained(str(random_model()), max_num_seqs=16)


def _sample(engine, fmt: str, forced: str) -> list[str]:
    guide = forced_guide(fmt, forced, [WEATHER, NOW], set())
    assert guide is not None and guide.kind == "lark"
    params = SamplingParams(max_tokens=256, temperature=1.0, n=3, seed=5, guide=guide)
    outputs = engine.generate(["What is the weather in Oslo?"], params)[0].outputs
    finished = [c.text for c in outputs if c.finish_reason == "stop"]
    assert len(finished) >= 2, [(c.finish_reason, c.text) for c in outputs]
    return finished


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_a_named_forced_call_reads_back_as_that_call(tiny, fmt):
    for text in _sample(tiny, fmt, "get_weather"):
        content, calls = parse_tool_calls(text, fmt, [WEATHER, NOW])
        assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"], text
        arguments = json.loads(calls[0]["function"]["arguments"])
        if fmt == "pythonic":  # Python literals: the booleans are True/False, read back as JSON's
            assert isinstance(arguments.get("metric", True), bool)
        jsonschema.validate(arguments, SCHEMAS["get_weather"])


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_required_calls_one_of_the_tools(tiny, fmt):
    for text in _sample(tiny, fmt, REQUIRED):
        content, calls = parse_tool_calls(text, fmt, [WEATHER, NOW])
        assert content is None and len(calls) == 1, text
        name = calls[0]["function"]["name"]
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS[name])


def test_markup_the_tokenizer_keeps_as_special_falls_back_to_a_json_document():
    assert forced_guide("kimi_k2", "now", [NOW], {"<|tool_call_begin|>"}) is None
    assert forced_guide("hermes", "now", [NOW], set()) is None  # hermes, llama3, mistral: JSON, as before
    assert forced_guide("qwen3_coder", "now", [NOW], {"<|tool_call_begin|>"}) is not None
