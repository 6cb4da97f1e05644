"""`--tool-parser`: a model's call format set by hand where its chat template teaches another (a fine-tune that
calls in Qwen3-Coder's XML under a Hermes template), or `none` to leave calls as content. Through `bulkgen run` on
a scripted Qwen3 under its real template."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bulkgen.batch.tools import READERS
from bulkgen.cli import cli
from bulkgen.models.registry import TOOL_PARSERS, parse_tool_parsers
from tests.support.reasoning import WEATHER, Case, Family, build_family
from tests.support.service import run_bodies, write_jsonl

XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
)
QWEN = Family(
    "qwen3",
    "qwen3.jinja",
    {
        "xml": Case(
            "What is the weather in Paris?",
            f"<think>\nTool.\n</think>\n\n{XML_CALL}<|im_end|>",
            tools=[WEATHER],
        )
    },
)


def _rows() -> list[dict]:
    return [{"custom_id": "xml", "method": "POST", "url": "/v1/chat/completions", "body": QWEN.body("xml")}]


@pytest.mark.slow
def test_the_flag_sets_the_format_or_turns_reading_off(tmp_path):
    path = build_family(tmp_path / "models", QWEN)
    model = ("--model", f"{QWEN.model}={path}")
    taught = run_bodies(tmp_path, "taught", _rows(), *model)["xml"]["choices"][0]  # hermes: not a hermes call
    assert (taught["finish_reason"], taught["message"]["content"]) == ("stop", XML_CALL)

    flagged = run_bodies(tmp_path, "flag", _rows(), *model, "--tool-parser", f"{QWEN.model}=qwen3_coder")
    choice = flagged["xml"]["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    off = run_bodies(tmp_path, "off", _rows(), *model, "--tool-parser", "none")["xml"]["choices"][0]
    assert (off["finish_reason"], off["message"]["content"]) == ("stop", XML_CALL)


def test_bad_values_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"--tool-parser 'x=yaml': the format must be one of auto, hermes"):
        parse_tool_parsers(["x=yaml"])
    rows = write_jsonl(tmp_path / "in.jsonl", _rows())
    args = ["run", str(rows), "--output", str(tmp_path / "out.jsonl"), "--storage", str(tmp_path)]
    result = CliRunner().invoke(cli, [*args, "--tool-parser", "nobody=hermes"])
    assert result.exit_code != 0 and "no served model is named 'nobody'" in result.output


def test_every_format_has_a_reader():
    assert set(TOOL_PARSERS) - {"auto"} == set(READERS)
