"""`bulkgen run` on a reasoning model (the scripted gpt-oss of bulkgen/lab/scripted.py, its real harmony
template and special tokens): the harmony channels are read into reasoning, answer and tool calls, and
`--reasoning-parser none` turns the reading off (the decoded text, channel names glued in, as content)."""

from __future__ import annotations

import pytest

from tests.support.reasoning import GPT_OSS, QWEN3, build_family
from tests.support.service import run_bodies


def _run(tmp_path, name: str, model_path, *flags: str) -> dict:
    rows = [
        {"custom_id": "oss", "method": "POST", "url": "/v1/chat/completions", "body": GPT_OSS.body("think")},
        {"custom_id": "tool", "method": "POST", "url": "/v1/chat/completions", "body": GPT_OSS.body("tool")},
    ]
    return run_bodies(tmp_path, name, rows, "--model", f"{GPT_OSS.model}={model_path}", *flags)


@pytest.mark.slow
def test_run_reads_harmony_and_the_flag_turns_it_off(tmp_path):
    path = build_family(tmp_path / "models", GPT_OSS)
    bodies = _run(tmp_path, "auto", path)
    message = bodies["oss"]["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == ("Blue light scatters most.", "Rayleigh scattering.")
    assert bodies["oss"]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    tool = bodies["tool"]["choices"][0]
    assert tool["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in tool["message"]["tool_calls"]] == ["get_weather"]

    raw = _run(tmp_path, "off", path, "--reasoning-parser", f"{GPT_OSS.model}=none")
    message = raw["oss"]["choices"][0]["message"]
    assert message["content"] == "analysisRayleigh scattering.assistantfinalBlue light scatters most."
    assert "reasoning" not in message
    assert raw["oss"]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert raw["tool"]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
def test_model_options_apply_where_a_line_sets_none_and_completions_are_never_read(tmp_path):
    path = build_family(tmp_path / "models", QWEN3)
    think = QWEN3.body("think", chat_template_kwargs={"enable_thinking": True})  # its own option wins
    rows = [
        {"custom_id": "own", "method": "POST", "url": "/v1/chat/completions", "body": think},
        {
            "custom_id": "model's",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": QWEN3.body("no_think"),
        },
    ]
    rows[1]["body"].pop("chat_template_kwargs")  # the flag's enable_thinking: false makes its prompt
    prompt = QWEN3.prompt(QWEN3.cases["think"])  # the same tokens as a completions prompt: never read
    raw = {"model": QWEN3.model, "prompt": prompt, "max_tokens": 100, "temperature": 0}
    flags = (
        "--chat-template-kwargs",
        f'{QWEN3.model}={{"enable_thinking": false}}',
        "--reasoning-parser",
        "think",
    )
    model = ("--model", f"{QWEN3.model}={path}")
    bodies = run_bodies(tmp_path, "options", rows, *model, *flags)
    own, models = (bodies[k]["choices"][0]["message"] for k in ("own", "model's"))
    assert (own["content"], own["reasoning"]) == (
        "Blue light scatters most.",
        "The user asks about the sky.\nRayleigh scattering.",
    )
    assert (models["content"], models["reasoning"]) == ("Blue light scatters most.", None)
    (fingerprint,) = {b["system_fingerprint"] for b in bodies.values()}  # one for the batch
    plain = run_bodies(tmp_path, "plain", rows[:1], *model, "--reasoning-parser", "think")
    assert plain["own"]["choices"][0]["message"] == own  # the same tokens for the line that set its own
    assert plain["own"]["system_fingerprint"] != fingerprint  # the model's default options change prompts
    completion = {"custom_id": "raw", "method": "POST", "url": "/v1/completions", "body": raw}
    bodies = run_bodies(tmp_path, "raw", [completion], *model, *flags)
    assert bodies["raw"]["choices"][0]["text"] == QWEN3.cases["think"].script.removesuffix("<|im_end|>")
    assert bodies["raw"]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
