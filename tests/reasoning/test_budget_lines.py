"""`thinking_token_budget` and structured outputs after reasoning, end to end: the scripted DeepSeek-R1 and
Qwen3 (bulkgen/lab/scripted.py) under their real templates, through `bulkgen serve` + the openai client and
through `bulkgen run`. The scripted model writes by position, so after the end of reasoning the budget forced
(`</think>` + "\\n\\n") it goes on with its script from that position: the answer is the rest of its script."""

from __future__ import annotations

import json

import pytest

from tests.reasoning.test_reasoning_service import ANSWER, REASONING, _row, family_paths  # noqa: F401
from tests.support.reasoning import DEEPSEEK_R1, QWEN3, build_family
from tests.support.service import read_lines, run_bodies, upload, wait_done, write_jsonl

SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": [1, 2]}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture
def budget_client(service, client, family_paths, monkeypatch):  # noqa: F811
    for name, path in family_paths.items():
        monkeypatch.setitem(service.svc.settings.models, name, str(path))
    return client


def _cut(family, budget: int) -> tuple[str, str]:
    """(reasoning, content) of the family's `think` script cut at `budget` reasoning tokens (prompt-opened)."""
    tok = family.tokenizer()
    script = tok.encode(family.cases["think"].script, add_special_tokens=False)
    forced = tok.encode("</think>\n\n", add_special_tokens=False)
    text = tok.decode(script[:budget] + forced + script[budget + len(forced) :], skip_special_tokens=True)
    reasoning, _, answer = text.partition("</think>")
    return reasoning.strip("\n"), answer.lstrip("\n")


def test_budgets_schemas_and_bad_budgets_through_serve(budget_client, tmp_path):
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    rows = [
        _row("free", DEEPSEEK_R1.body("think")),
        _row("cut", DEEPSEEK_R1.body("think", thinking_token_budget=3)),
        _row("zero", DEEPSEEK_R1.body("think", thinking_token_budget=0)),
        _row("roomy", DEEPSEEK_R1.body("think", thinking_token_budget=1000)),
        _row("schema", DEEPSEEK_R1.body("think", response_format=schema)),
        *(
            _row(f"bad{i}", DEEPSEEK_R1.body("think", thinking_token_budget=v))
            for i, v in enumerate((-1, "9", 2.5))
        ),
    ]
    rows = [{**r, "body": {**r["body"], "max_tokens": 200}} for r in rows]
    batch = budget_client.batches.create(
        input_file_id=upload(budget_client, write_jsonl(tmp_path / "budget.jsonl", rows)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = wait_done(budget_client, batch.id, timeout=300)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 5, 3)
    bodies = {x["custom_id"]: x["response"]["body"] for x in read_lines(budget_client, batch.output_file_id)}
    errors = {
        x["custom_id"]: x["response"]["body"]["error"] for x in read_lines(budget_client, batch.error_file_id)
    }
    assert {c: (e["code"], e["param"]) for c, e in errors.items()} == {
        f"bad{i}": ("invalid_parameter", "body.thinking_token_budget") for i in range(3)
    }
    message = lambda c: bodies[c]["choices"][0]["message"]  # noqa: E731
    assert (message("free")["reasoning"], message("free")["content"]) == (REASONING, ANSWER)
    assert bodies["roomy"]["choices"] == bodies["free"]["choices"]  # a budget past the reasoning: no change
    for name, budget in (("cut", 3), ("zero", 0)):
        choice, usage = bodies[name]["choices"][0], bodies[name]["usage"]
        assert (choice["message"]["reasoning"] or "", choice["message"]["content"]) == _cut(
            DEEPSEEK_R1, budget
        )
        assert choice["message"]["content"] and choice["finish_reason"] == "stop"
        # the parser counts the reasoning with its closing tag: the budget's tokens and the forced `</think>`
        assert usage["completion_tokens_details"]["reasoning_tokens"] == budget + 1
    structured = bodies["schema"]["choices"][0]
    assert structured["message"]["reasoning"] == REASONING  # the reasoning is free
    assert json.loads(structured["message"]["content"])["a"] in (1, 2)
    assert structured["finish_reason"] == "stop"


@pytest.mark.slow
def test_budget_through_run_on_chat_and_responses(tmp_path):
    path = build_family(tmp_path / "models", QWEN3)
    flags = ("--model", f"{QWEN3.model}={path}")
    chat = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions"}
    rows = [
        {**chat, "body": QWEN3.body("think", thinking_token_budget=2)},
        {**chat, "custom_id": "free", "body": QWEN3.body("think")},
    ]
    bodies = run_bodies(tmp_path, "chat", rows, *flags)
    question = QWEN3.cases["think"].question
    resp = {"model": QWEN3.model, "input": question, "temperature": 0, "thinking_token_budget": 2}
    row = {"custom_id": "resp", "method": "POST", "url": "/v1/responses", "body": resp}
    response = run_bodies(tmp_path, "resp", [row], *flags)["resp"]

    tok = QWEN3.tokenizer()
    script = tok.encode(QWEN3.cases["think"].script, add_special_tokens=False)
    opened = script.index(tok.convert_tokens_to_ids("<think>")) + 1
    two = tok.decode(script[opened : opened + 2]).strip("\n")  # the reasoning: two tokens after `<think>`
    choice = bodies["chat"]["choices"][0]
    assert choice["message"]["reasoning"] == two != bodies["free"]["choices"][0]["message"]["reasoning"]
    assert choice["message"]["content"] and choice["finish_reason"] == "stop"
    spent = opened + 2 + 1  # `<think>`, the budget's two tokens, the forced `</think>`
    assert bodies["chat"]["usage"]["completion_tokens_details"]["reasoning_tokens"] == spent
    items = {i["type"]: i for i in response["output"]}
    assert items["reasoning"]["content"][0]["text"] == two
    assert items["message"]["content"][0]["text"] == choice["message"]["content"]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == spent

    own = {**chat, "custom_id": "own", "body": QWEN3.body("think", thinking_token_budget=1000)}
    flagged = run_bodies(
        tmp_path,
        "flag",
        [{**rows[1], "custom_id": "model's"}, own],
        *flags,
        "--thinking-token-budget",
        f"{QWEN3.model}=2",
    )
    assert (
        flagged["model's"]["choices"] == bodies["chat"]["choices"]
    )  # the model's budget, where a line sets none
    assert flagged["own"]["choices"] == bodies["free"]["choices"]  # the line's own budget wins

    unread = run_bodies(tmp_path, "none", [rows[0]], *flags, "--reasoning-parser", "none")["chat"]
    text = tok.decode(script, skip_special_tokens=True)  # no parser: the budget is accepted and ignored
    assert unread["choices"][0]["message"]["content"] == text


def test_the_model_flag_reads_budgets_and_refuses_bad_ones():
    from bulkgen.models.registry import EVERY_MODEL, parse_thinking_budgets

    assert parse_thinking_budgets(["r1=512", "0"]) == {"r1": 512, EVERY_MODEL: 0}
    for bad in ("-1", "r1=many", "r1=2.5"):
        with pytest.raises(ValueError, match="--thinking-token-budget"):
            parse_thinking_budgets([bad])
