"""chat_template_kwargs and reasoning_effort reach the real chat templates; a bad value is that line's 400
naming its field."""

from __future__ import annotations

import json

import pytest

from bulkgen.batch.prepare import render_chat
from bulkgen.batch.requests import CHAT, LineError, parse_line
from tests.support.reasoning import GPT_OSS, QWEN3


def _line(body: dict) -> str:
    return json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": body})


def test_enable_thinking_and_unknown_options_reach_the_template():
    body = QWEN3.body("think", chat_template_kwargs={"enable_thinking": False, "no_such_option": 1})
    prompt = render_chat(parse_line(_line(body), 1, CHAT), QWEN3.tokenizer())
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    default = render_chat(parse_line(_line(QWEN3.body("think")), 1, CHAT), QWEN3.tokenizer())
    assert default.endswith("<|im_start|>assistant\n")


def test_reasoning_effort_reaches_gpt_oss_template_beside_other_options():
    body = GPT_OSS.body(
        "think", reasoning_effort="high", chat_template_kwargs={"model_identity": "You are Bob."}
    )
    prompt = render_chat(parse_line(_line(body), 1, CHAT), GPT_OSS.tokenizer())
    assert "Reasoning: high" in prompt and prompt.startswith("<|start|>system<|message|>You are Bob.\n")


@pytest.mark.parametrize(
    ("value", "param"),
    [
        (["enable_thinking"], "body.chat_template_kwargs"),
        ("enable_thinking=false", "body.chat_template_kwargs"),
        ({"tokenize": True}, "body.chat_template_kwargs.tokenize"),
        ({"add_generation_prompt": False}, "body.chat_template_kwargs.add_generation_prompt"),
    ],
)
def test_bad_chat_template_kwargs_are_the_lines_400(value, param):
    with pytest.raises(LineError) as err:
        parse_line(_line(QWEN3.body("think", chat_template_kwargs=value)), 1, CHAT)
    assert (err.value.code, err.value.param) == ("invalid_parameter", param)
