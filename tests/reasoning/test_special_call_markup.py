"""Markers an answer is read by that its tokenizer has as special tokens. A family whose tool-call markers are special tokens (Kimi K2: `<|tool_call_begin|>` and the rest), with its
real chat template and a scripted model that writes a free (unforced) call: decoding that skips special tokens
would erase the call's markup and leave `functions.get_weather:0{...}` as content; the call comes back as
`tool_calls`, its reasoning apart (through serve and run: test_more_families.py). And a Qwen3 whose tokenizer has `<think>` and `</think>` as
special tokens (as some fine-tunes' do): the reasoning is still read apart from the answer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bulkgen.lab.scripted import FAMILIES, build_scripted_model
from tests.support.reasoning import QWEN3, TEMPLATES, WEATHER, Case, Family
from tests.support.service import run_bodies

CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)
KIMI = Family(
    "kimi_k2",
    "Kimi-K2-Thinking.jinja",
    {
        "plain": Case("Why is the sky blue?", "<think>Rayleigh.</think>Blue light scatters most.<|im_end|>"),
        "call": Case(
            "What is the weather in Paris?",
            f"<think>Need the weather tool.</think>{CALL}<|im_end|>",
            tools=[WEATHER],
        ),
    },
)


def test_skipping_special_tokens_would_erase_the_call():
    tokenizer = KIMI.tokenizer()
    assert tokenizer.decode(tokenizer.encode(CALL), skip_special_tokens=True) == (
        'functions.get_weather:0{"city": "Paris"}'  # what a Kimi answer was before: the markup gone
    )


@pytest.mark.slow
def test_special_think_markers_are_read(tmp_path):
    qwen = FAMILIES["qwen3"]
    think_special = replace(  # <think> and </think> special, the rest as Qwen3's
        qwen,
        special=(*qwen.special, "<think>", "</think>"),
        added=tuple(t for t in qwen.added if "think" not in t),
    )
    case = QWEN3.cases["think"]
    template = (TEMPLATES / QWEN3.template).read_text()
    prompt_len = len(QWEN3.prompt_ids(case))
    path = build_scripted_model(tmp_path / "model", think_special, template, {prompt_len: case.script})
    row = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions", "body": QWEN3.body("think")}
    bodies = run_bodies(
        tmp_path, "think", [row], "--model", f"{QWEN3.model}={path}", "--reasoning-parser", "think"
    )
    message = bodies["q"]["choices"][0]["message"]
    assert message["content"] == "Blue light scatters most."
    assert message["reasoning"] == "The user asks about the sky.\nRayleigh scattering."
