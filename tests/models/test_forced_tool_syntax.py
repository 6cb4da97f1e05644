"""Forced tool calls (`tool_choice` required or named) written in each family's own call syntax: on a tiny
random model (which writes no call by itself; its byte-level tokenizer spells each marker byte by byte),
under the grammar bulkgen builds for that format, every output that finishes is read back by the format's
reader as one call of the forced tool, with arguments valid for its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bulkgen.batch.prepare import tokenize
from bulkgen.batch.requests import CHAT, parse_line
from bulkgen.batch.structured import REQUIRED
from bulkgen.batch.tools import WRITERS, forced_guide, parse_tool_calls
from bulkgen.engine import Engine, SamplingParams
from bulkgen.lab.tiny import build_tokenizer
from tests.support.service import chat_row, random_model
from tests.support.tool_formats import BOUNDED_WEATHER, TEMPLATES, function_tool

WEATHER = BOUNDED_WEATHER  # every value bounded, so calls finish on a random model
NOW = function_tool("now", {})
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, NOW)}


CASES = [(fmt, forced) for fmt in sorted(WRITERS) for forced in ("get_weather", REQUIRED)]


@pytest.fixture(scope="module")
def finished() -> dict[tuple[str, str], list[str]]:
    """Every case's outputs that finished, sampled in one batch (n=3 each, temperature 1)."""
    engine = Engine.from_pretrained(str(random_model()), max_num_seqs=48)
    params = [
        SamplingParams(
            max_tokens=256,
            temperature=1.0,
            n=3,
            seed=5,
            guide=forced_guide(fmt, forced, [WEATHER, NOW], set()),
        )
        for fmt, forced in CASES
    ]
    outputs = engine.generate(["What is the weather in Oslo?"] * len(CASES), params)
    return {
        case: [c.text for c in o.outputs if c.finish_reason == "stop"]
        for case, o in zip(CASES, outputs, strict=True)
    }


@pytest.mark.parametrize(("fmt", "forced"), CASES)
def test_a_forced_call_reads_back_as_one_call_of_the_forced_tool(finished, fmt, forced):
    assert forced_guide(fmt, forced, [WEATHER, NOW], set()).kind == "lark"
    assert len(finished[fmt, forced]) >= 2, finished[fmt, forced]
    for text in finished[fmt, forced]:
        content, calls = parse_tool_calls(text, fmt, [WEATHER, NOW])
        assert content is None and len(calls) == 1, text
        name = calls[0]["function"]["name"]
        assert name == forced or forced == REQUIRED
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS[name])


def test_markup_the_tokenizer_keeps_as_special_falls_back_to_a_json_document():
    assert forced_guide("kimi_k2", "now", [NOW], {"<|tool_call_begin|>"}) is None
    assert forced_guide("hermes", "now", [NOW], set()) is None  # hermes, llama3, mistral: JSON, as before
    assert forced_guide("qwen3_coder", "now", [NOW], {"<|tool_call_begin|>"}) is not None


def test_a_tokenizer_holding_the_markers_as_special_tokens_gets_the_json_document():
    """Kimi's markers as special tokens (its own tokenizer marks its <|...|> tokens so): the grammar could not
    spell them and decoding would drop them, so the forced call is the JSON document of structured.py."""

    def forced_syntax(special: list[str]) -> bool:
        tok = build_tokenizer()
        tok.chat_template = (TEMPLATES / "Kimi-K2-Thinking.jinja").read_text()
        tok.add_special_tokens({"additional_special_tokens": special})
        row = chat_row("a", "Weather?", tools=[NOW], tool_choice="required")
        request = parse_line(json.dumps(row), 1, CHAT)
        tokenize(request, tok)
        return request.forced_syntax and request.sampling["guide"].kind == "lark"

    assert forced_syntax([])
    assert not forced_syntax(["<|tool_calls_section_begin|>", "<|tool_call_begin|>"])
