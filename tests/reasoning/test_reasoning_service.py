"""Reasoning models end to end through `bulkgen serve` (real uvicorn, Ray workers, the openai client): tiny
scripted models (bulkgen/lab/scripted.py) write exactly what Qwen3, DeepSeek-R1 and gpt-oss write, under their
real chat templates and marker tokens, and each line's reasoning, answer and tool calls land in their fields.

The session's service serves its text models; `reasoning_client` adds the three scripted models to its settings
for a test (monkeypatch, undone after), so the same service, workers and Ray run them."""

from __future__ import annotations

import json

import pytest

from tests.support.reasoning import DEEPSEEK_R1, GPT_OSS, QWEN3, REASONING_FAMILIES, build_family
from tests.support.service import read_lines, upload, wait_done, write_jsonl

ANSWER, REASONING = "Blue light scatters most.", "The user asks about the sky.\nRayleigh scattering."


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning-models")
    return {f.model: build_family(root, f) for f in REASONING_FAMILIES}


@pytest.fixture
def reasoning_client(service, client, family_paths, monkeypatch):
    for name, path in family_paths.items():
        monkeypatch.setitem(service.svc.settings.models, name, str(path))
    return client


def _run(client, tmp_path, rows: list, endpoint: str = "/v1/chat/completions"):
    name = rows[0]["custom_id"]
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / f"{name}.jsonl", rows)).id,
        endpoint=endpoint,
        completion_window="24h",
    )
    batch = wait_done(client, batch.id, timeout=300)
    assert batch.status == "completed" and batch.request_counts.failed == 0, read_lines(
        client, batch.error_file_id
    )
    return batch, {
        line["custom_id"]: line["response"]["body"] for line in read_lines(client, batch.output_file_id)
    }


def _row(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _rows(family, cut_at: int, *more: dict) -> list[dict]:
    """The family's `think` question twice over, `n: 2` sampled, and cut after `cut_at` tokens; then `more`."""
    think = _row(f"{family.name}-think", family.body("think", n=2, temperature=1.0, seed=3))
    return [think, _row(f"{family.name}-cut", family.body("think", max_tokens=cut_at)), *more]


def _tokens(family, text: str) -> int:
    return len(family.tokenizer().encode(text, add_special_tokens=False))


def _batch_reasoning(batch, bodies) -> None:
    """The batch's usage sums its lines' reasoning tokens."""
    lines = sum(b["usage"]["completion_tokens_details"]["reasoning_tokens"] for b in bodies.values())
    assert batch.usage.output_tokens_details.reasoning_tokens == lines > 0


def test_qwen3_reasoning_answer_and_enable_thinking(reasoning_client, tmp_path):
    rows = _rows(QWEN3, 10, _row("qwen-no-think", QWEN3.body("no_think")))
    batch, bodies = _run(reasoning_client, tmp_path, rows)
    think = bodies["qwen3-think"]
    assert [c["index"] for c in think["choices"]] == [0, 1]
    for choice in think["choices"]:  # each choice read on its own
        message = choice["message"]
        assert (message["content"], message["reasoning"], message["reasoning_content"]) == (
            ANSWER,
            REASONING,
            REASONING,
        )
        assert choice["finish_reason"] == "stop"
    spent = _tokens(QWEN3, f"<think>\n{REASONING}\n</think>")
    assert think["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2 * spent
    plain = bodies["qwen-no-think"]["choices"][0]["message"]
    assert (plain["content"], plain["reasoning"]) == (ANSWER, None)  # enable_thinking reached the template
    cut = bodies["qwen3-cut"]["choices"][0]
    assert (cut["message"]["content"], cut["finish_reason"]) == (None, "length")
    assert cut["message"]["reasoning"] == "The user"  # `<think>`, "\n" and 8 more tokens, kept
    assert bodies["qwen3-cut"]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 10
    _batch_reasoning(batch, bodies)


def test_deepseek_r1_whose_prompt_opens_the_reasoning(reasoning_client, tmp_path):
    rows = [_row("r1", DEEPSEEK_R1.body("think")), _row("r1-cut", DEEPSEEK_R1.body("think", max_tokens=5))]
    batch, bodies = _run(reasoning_client, tmp_path, rows)
    message = bodies["r1"]["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == (ANSWER, REASONING)
    assert bodies["r1"]["usage"]["completion_tokens_details"]["reasoning_tokens"] == _tokens(
        DEEPSEEK_R1, f"{REASONING}\n</think>"
    )
    cut = bodies["r1-cut"]["choices"][0]
    assert (cut["message"]["content"], cut["message"]["reasoning"], cut["finish_reason"]) == (
        None,
        "The u",
        "length",
    )
    _batch_reasoning(batch, bodies)


def test_gpt_oss_harmony_channels_and_tool_call(reasoning_client, tmp_path):
    batch, bodies = _run(
        reasoning_client, tmp_path, _rows(GPT_OSS, 14, _row("oss-tool", GPT_OSS.body("tool")))
    )
    assert len(bodies["gpt_oss-think"]["choices"]) == 2
    for choice in bodies["gpt_oss-think"]["choices"]:
        message = choice["message"]
        assert (message["content"], message["reasoning"], choice["finish_reason"]) == (
            ANSWER,
            "Rayleigh scattering.",
            "stop",
        )
    tool = bodies["oss-tool"]["choices"][0]
    assert tool["finish_reason"] == "tool_calls" and tool["message"]["content"] is None
    assert tool["message"]["reasoning"] == "Need the weather tool."
    [call] = tool["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Paris"
    }
    cut = bodies["gpt_oss-cut"]["choices"][0]
    assert (cut["message"]["content"], cut["finish_reason"]) == (None, "length")
    assert cut["message"]["reasoning"] == "Rayl"  # after <|channel|>, "analysis" (8 tokens) and <|message|>
    _batch_reasoning(batch, bodies)


def test_responses_lines_return_a_reasoning_item_then_the_message(reasoning_client, tmp_path):
    url = "/v1/responses"
    rows = [
        _row("resp", {"model": QWEN3.model, "input": QWEN3.cases["think"].question, "temperature": 0}, url),
        _row(
            "resp-cut",
            {"model": QWEN3.model, "input": QWEN3.cases["think"].question, "max_output_tokens": 16},
            url,
        ),
    ]
    batch, bodies = _run(reasoning_client, tmp_path, rows, url)
    done = bodies["resp"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    reasoning, message = done["output"]
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": REASONING}]
    assert message["content"][0]["text"] == ANSWER
    assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == _tokens(
        QWEN3, f"<think>\n{REASONING}\n</think>"
    )
    cut = bodies["resp-cut"]
    assert cut["status"] == "incomplete" and [item["type"] for item in cut["output"]] == ["reasoning"]
    assert batch.usage.output_tokens_details.reasoning_tokens == sum(
        b["usage"]["output_tokens_details"]["reasoning_tokens"] for b in bodies.values()
    )
