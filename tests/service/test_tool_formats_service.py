"""Tool calls of the new formats through `bulkgen serve` and the openai client: a model whose tokenizer
carries Kimi K2's or Qwen3-Coder's real chat template (tests/data/chat_templates), forced calls written in
that family's own syntax and read back by its reader, landing in the output file as `tool_calls` with
`finish_reason: "tool_calls"`. The model has random weights: the calls come from the grammar alone."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.support.service import chat_row, model_with_template, read_lines, upload, wait_done, write_jsonl
from tests.support.tool_formats import BOUNDED_WEATHER, TEMPLATES

WEATHER = BOUNDED_WEATHER


@pytest.fixture(params=["Kimi-K2-Thinking.jinja", "Qwen3-Coder.jinja"])
def answers(request, service, client, monkeypatch, tmp_path):
    name = f"tiny-{request.param.split('.')[0].lower()}"
    template = (TEMPLATES / request.param).read_text()
    monkeypatch.setitem(service.svc.settings.models, name, str(model_with_template(template)))
    rows = [
        chat_row(f"required-{i}", "Weather in Oslo?", 200, tools=[WEATHER], tool_choice="required", seed=i)
        for i in range(3)
    ]
    rows.append(
        chat_row(
            "named",
            "Weather?",
            200,
            tools=[WEATHER],
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    for row in rows:
        row["body"]["model"] = name
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    batch = client.batches.create(
        input_file_id=upload(client, path).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_done(client, batch.id, timeout=300)
    assert batch.status == "completed" and batch.request_counts.failed == 0, batch
    lines = {line["custom_id"]: line["response"]["body"] for line in read_lines(client, batch.output_file_id)}
    return request.param, lines


def test_forced_calls_come_back_as_tool_calls(answers):
    template, lines = answers
    for custom_id, body in lines.items():
        (choice,) = body["choices"]
        # a call forced by name finishes with "stop", as the hosted API answers; "required" with "tool_calls"
        assert choice["finish_reason"] == ("stop" if custom_id == "named" else "tool_calls"), choice
        assert choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        if template.startswith("Kimi"):  # the id Kimi's reader takes from `functions.NAME:IDX`
            assert call["id"] == "functions.get_weather:0"
        else:
            assert call["id"].startswith("call_")
