"""The reasoning parsers on the exact texts each family emits, tokenized by tokenizers that give the markers
their real status (bulkgen/lab/scripted.py), under the families' real chat templates (tests/data/chat_templates)."""

from __future__ import annotations

import pytest

from bulkgen.batch.reasoning import HARMONY, THINK, opens_reasoning, read_output, reasoning_parser
from bulkgen.lab.tiny import build_tokenizer
from tests.support.reasoning import DEEPSEEK_R1, GPT_OSS, QWEN3


def _read(family, text: str, opened: bool = False):
    tok = family.tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    decoded = tok.decode(ids, skip_special_tokens=True)  # what the engine's text holds
    return read_output(reasoning_parser(tok.chat_template, tok), decoded, ids, tok, opened)


def test_each_template_teaches_its_parser():
    assert [
        reasoning_parser(f.tokenizer().chat_template, f.tokenizer()) for f in (QWEN3, DEEPSEEK_R1, GPT_OSS)
    ] == [
        THINK,
        THINK,
        HARMONY,
    ]
    tiny = build_tokenizer()  # a template that teaches no reasoning
    assert reasoning_parser(tiny.chat_template, tiny) is None


def test_which_generation_prompts_open_the_reasoning():
    question = QWEN3.cases["think"]
    assert opens_reasoning(DEEPSEEK_R1.prompt(DEEPSEEK_R1.cases["think"]))
    assert not opens_reasoning(QWEN3.prompt(question))
    no_think = QWEN3.prompt(QWEN3.cases["no_think"])
    assert no_think.endswith("<think>\n\n</think>\n\n") and not opens_reasoning(no_think)
    asks = QWEN3.tokenizer().apply_chat_template(
        [{"role": "user", "content": "What does <think> mean?"}], add_generation_prompt=True, tokenize=False
    )
    assert not opens_reasoning(asks)  # a tag in a message opens nothing


def test_qwen3_think_block_then_answer():
    reading = _read(QWEN3, "<think>\nLet me see.\nRayleigh.\n</think>\n\nBlue light scatters most.<|im_end|>")
    assert (reading.reasoning, reading.content) == ("Let me see.\nRayleigh.", "Blue light scatters most.")
    tok = QWEN3.tokenizer()
    assert reading.reasoning_tokens == len(tok.encode("<think>\nLet me see.\nRayleigh.\n</think>"))


def test_an_empty_think_block_is_no_reasoning_and_no_tags_is_all_answer():
    empty = _read(QWEN3, "<think>\n\n</think>\n\nBlue.<|im_end|>")
    assert (empty.reasoning, empty.content) == (None, "Blue.")
    plain = _read(QWEN3, "Blue.<|im_end|>")
    assert (plain.reasoning, plain.content, plain.reasoning_tokens) == (None, "Blue.", 0)


def test_output_cut_inside_its_reasoning_has_no_answer():
    cut = _read(QWEN3, "<think>\nLet me see")
    assert (cut.reasoning, cut.content) == ("Let me see", None)
    opened = _read(DEEPSEEK_R1, "The user asks", opened=True)
    assert (opened.reasoning, opened.content, opened.reasoning_tokens) == ("The user asks", None, 13)


def test_deepseek_r1_output_holds_only_the_closing_tag():
    reading = _read(
        DEEPSEEK_R1, "Hmm.\nRayleigh.\n</think>\n\nBlue light scatters most.<｜end▁of▁sentence｜>", True
    )
    assert (reading.reasoning, reading.content) == ("Hmm.\nRayleigh.", "Blue light scatters most.")


def test_harmony_channels_from_token_ids():
    text = (
        "<|channel|>analysis<|message|>Rayleigh scattering.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Blue light scatters most.<|return|>"
    )
    tok = GPT_OSS.tokenizer()
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == (
        "analysisRayleigh scattering.assistantfinalBlue light scatters most."
    )  # why the text alone cannot be read
    reading = _read(GPT_OSS, text)
    assert (reading.reasoning, reading.content, reading.calls) == (
        "Rayleigh scattering.",
        "Blue light scatters most.",
        [],
    )
    assert reading.reasoning_tokens == len(
        tok.encode("<|channel|>analysis<|message|>Rayleigh scattering.<|end|>")
    )


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json",
        " to=functions.get_weather<|channel|>commentary json",  # the order the template renders calls in
    ],
)
def test_harmony_tool_call(header):
    text = f'<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant{header}<|message|>{{"city":"Paris"}}<|call|>'
    reading = _read(GPT_OSS, text)
    assert reading.content is None and reading.reasoning == "Need it."
    assert reading.calls == [{"name": "get_weather", "arguments": '{"city":"Paris"}'}]


def test_harmony_cut_inside_analysis_and_plain_text():
    cut = _read(GPT_OSS, "<|channel|>analysis<|message|>Rayleigh sca")
    assert (cut.reasoning, cut.content) == ("Rayleigh sca", None)
    header = _read(GPT_OSS, "<|channel|>analy")  # cut before its message began
    assert (header.reasoning, header.content, header.reasoning_tokens) == (None, None, 6)
    plain = _read(GPT_OSS, "Just text.")
    assert (plain.reasoning, plain.content) == (None, "Just text.")
