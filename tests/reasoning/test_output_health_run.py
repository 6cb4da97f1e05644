"""Output health end to end: `bulkgen run` on a scripted Qwen3 (its real template, bulkgen/lab/scripted.py)
whose answers are a good one, one cut inside its reasoning, an empty one and a botched tool call. Every line
is a 200, so the batch is "completed"; its summary says which answers are not answers, naming them."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bulkgen.cli import cli
from tests.support.reasoning import QWEN3, WEATHER, Case, Family, build_family
from tests.support.service import write_jsonl

BROKEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par</tool_call>'
FAMILY = Family(
    "qwen3",
    "qwen3.jinja",
    {
        "think": QWEN3.cases["think"],
        "empty": Case("Say nothing at all. " * 7, "<think>\n\n</think>\n\n<|im_end|>"),
        "broken": Case(
            "What is the weather in Paris?",
            f"<think>\nUse the tool.\n</think>\n\n{BROKEN_CALL}<|im_end|>",
            tools=[WEATHER],
        ),
    },
)


@pytest.mark.slow
def test_run_summary_names_the_answers_that_are_not_answers(tmp_path):
    path = build_family(tmp_path / "models", FAMILY)
    bodies = {
        "good": FAMILY.body("think"),
        "cut": FAMILY.body("think", max_tokens=4),
        "empty": FAMILY.body("empty"),
        "broken": FAMILY.body("broken"),
    }
    rows = [
        {"custom_id": k, "method": "POST", "url": "/v1/chat/completions", "body": b}
        for k, b in bodies.items()
    ]
    out = tmp_path / "out.jsonl"
    args = ["run", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--output", str(out)]
    result = CliRunner().invoke(
        cli, [*args, "--storage", str(tmp_path / "store"), "--model", f"{FAMILY.model}={path}"]
    )
    assert result.exit_code == 0, result.output
    assert "4 completed, 0 failed" in result.output
    answers = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, out.read_text().splitlines())}
    assert answers["good"]["choices"][0]["message"]["content"] == "Blue light scatters most."
    cut = answers["cut"]["choices"][0]
    assert (cut["finish_reason"], cut["message"]["content"]) == ("length", None)
    assert answers["broken"]["choices"][0]["message"]["content"] == BROKEN_CALL  # left as content

    lines = {line.split("  ")[0]: line for line in result.output.splitlines()}
    assert "length 1, stop 3" in lines["finish reasons"]
    assert lines["reasoning without answer"].endswith("1 (cut)")
    assert lines["empty answer"].endswith("1 (empty)")
    assert lines["tool call unparsed"].endswith("1 (broken)")
    assert "schema failed" not in lines  # none asked for JSON
