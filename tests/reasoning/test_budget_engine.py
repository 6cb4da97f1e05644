"""The reasoning gate in the engine (bulkgen/engine/features/reasoning_gate.py) on the scripted Qwen3 and DeepSeek-R1 of
bulkgen/lab/scripted.py, step by step and overlapped: a thinking budget cuts the reasoning at exactly the
budget and forces `</think>` + "\\n\\n", a budget past the reasoning changes no token, and a grammar applies
only after the reasoning. The scripted model writes by position, so after a forced end it goes on with its
script from that position: the tokens expected are the script's, with the forced ones in place."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bulkgen.engine import SamplingParams, engine_class
from bulkgen.engine.features.guide import Guide
from bulkgen.engine.features.reasoning_gate import ReasoningSpec
from tests.support.reasoning import DEEPSEEK_R1, GPT_OSS, QWEN3, build_family


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    return {f.name: build_family(root, f) for f in (QWEN3, DEEPSEEK_R1, GPT_OSS)}


def _spec(tok, opened: bool, budget: int | None) -> ReasoningSpec:
    ids = lambda text: tuple(tok.encode(text, add_special_tokens=False))  # noqa: E731
    return ReasoningSpec(ids("<think>"), ids("</think>"), ids("\n\n"), opened, budget)


def _generate(path, family, overlap: bool, **params) -> tuple[list[int], str, list[int]]:
    engine = engine_class().from_pretrained(str(path), async_scheduling=overlap)
    case = family.cases["think"]
    out = engine.generate([family.prompt_ids(case)], SamplingParams(max_tokens=200, temperature=0, **params))
    choice = out[0].outputs[0]
    return (
        choice.token_ids,
        choice.finish_reason,
        engine.tokenizer.encode(case.script, add_special_tokens=False),
    )


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [0, 3])
def test_a_budget_cuts_the_reasoning_where_the_prompt_opened_it(paths, overlap, budget):
    tok = DEEPSEEK_R1.tokenizer()
    spec = _spec(tok, True, budget)
    got, reason, script = _generate(paths["deepseek_r1"], DEEPSEEK_R1, overlap, reasoning=spec)
    forced = list(spec.end_ids + spec.answer_ids)
    assert got == script[:budget] + forced + script[budget + len(forced) :]
    assert reason == "stop"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_budget_counts_from_a_generated_think(paths, overlap):
    tok = QWEN3.tokenizer()
    spec = _spec(tok, False, 2)
    got, reason, script = _generate(paths["qwen3"], QWEN3, overlap, reasoning=spec)
    opened = script.index(spec.open_ids[-1]) + 1  # the reasoning starts after the generated <think>
    forced = list(spec.end_ids + spec.answer_ids)
    assert got == script[: opened + 2] + forced + script[opened + 2 + len(forced) :]
    assert reason == "stop"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_budget_cuts_harmony_analysis_into_the_final_channel(paths, overlap):
    tok = GPT_OSS.tokenizer()
    ids = lambda text: tuple(tok.encode(text, add_special_tokens=False))  # noqa: E731
    final = ids("<|start|>assistant<|channel|>final<|message|>")
    spec = ReasoningSpec(ids("<|channel|>analysis<|message|>"), ids("<|end|>"), final, False, 1)
    got, reason, script = _generate(paths["gpt_oss"], GPT_OSS, overlap, reasoning=spec)
    opened = len(spec.open_ids)  # the script opens the analysis channel at once
    forced = list(spec.end_ids + final)
    assert got == script[: opened + 1] + forced + script[opened + 1 + len(forced) :]
    assert reason == "stop"
    free, _, _ = _generate(paths["gpt_oss"], GPT_OSS, overlap, reasoning=replace(spec, budget=1000))
    assert free == script


@pytest.mark.parametrize("overlap", [False, True])
def test_a_budget_past_the_reasoning_changes_nothing(paths, overlap):
    tok = QWEN3.tokenizer()
    free, _, script = _generate(paths["qwen3"], QWEN3, overlap)
    reasoning = script.index(tok.convert_tokens_to_ids("</think>"))  # <think> and its text, before the end
    for budget in (reasoning, reasoning + 50):  # the end is forced exactly where the script writes it
        gated, reason, _ = _generate(paths["qwen3"], QWEN3, overlap, reasoning=_spec(tok, False, budget))
        assert gated == free == script
        assert reason == "stop"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_applies_only_after_the_reasoning(paths, overlap):
    tok = DEEPSEEK_R1.tokenizer()
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    guide = Guide("json_schema", json.dumps(schema))
    got, reason, script = _generate(
        paths["deepseek_r1"], DEEPSEEK_R1, overlap, reasoning=_spec(tok, True, None), guide=guide
    )
    end = script.index(tok.convert_tokens_to_ids("</think>"))
    assert got[: end + 1] == script[: end + 1]  # the reasoning unconstrained, as scripted
    text = tok.decode(got, skip_special_tokens=True)
    answer = text.partition("</think>")[2]
    assert answer.startswith("\n\n")
    assert isinstance(json.loads(answer)["a"], int)
    assert reason == "stop"


def test_invalid_budgets_are_refused():
    for bad in (-1, True):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            ReasoningSpec((1,), (2,), (), False, bad)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_applies_from_the_first_token_of_an_answer_without_reasoning(paths, overlap):
    tok = QWEN3.tokenizer()
    engine = engine_class().from_pretrained(str(paths["qwen3"]), async_scheduling=overlap)
    case = QWEN3.cases["no_think"]  # its script answers at once, no `<think>`
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=50,
        temperature=0,
        reasoning=_spec(tok, False, 5),
        guide=Guide("json_schema", json.dumps(schema)),
    )
    choice = engine.generate([QWEN3.prompt_ids(case)], params)[0].outputs[0]
    assert json.loads(tok.decode(choice.token_ids, skip_special_tokens=True))["a"] in (1, 2)
    assert choice.finish_reason == "stop"
