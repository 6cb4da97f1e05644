"""`bulkgen run samples/responses.jsonl` on the embedded defaults (the bundled trained model), in process,
as docs/responses.md shows it: every answer parses as the openai package's Response, JSON formats validate,
metadata comes back, and the line with tools is refused by name."""

from __future__ import annotations

import json

import jsonschema
from click.testing import CliRunner
from openai.types.responses import Response

from bulkgen.cli import cli
from tests.models.english import looks_like_english
from tests.support.service import SAMPLES


def test_run_the_responses_sample(tmp_path):
    out = tmp_path / "res.jsonl"
    result = CliRunner().invoke(
        cli,
        ["run", str(SAMPLES / "responses.jsonl"), "--output", str(out), "--storage", str(tmp_path / "store")],
    )
    assert result.exit_code == 0, result.output
    assert "7 completed, 1 failed" in result.output and "ask-000: " in result.output
    rows = {
        row["custom_id"]: row
        for row in map(json.loads, (SAMPLES / "responses.jsonl").read_text().splitlines())
    }
    output = {
        line["custom_id"]: Response.model_validate(line["response"]["body"])
        for line in map(json.loads, out.read_text().splitlines())
    }
    assert set(output) == set(rows) - {"ask-007"}
    assert (
        sum(
            looks_like_english(output[cid].output_text)
            for cid in ("ask-000", "ask-001", "ask-002", "ask-003", "ask-004")
        )
        >= 4
    )
    assert output["ask-001"].metadata == {"team": "support", "batch": "demo"}
    assert output["ask-004"].status == "incomplete" and output["ask-004"].usage.output_tokens == 16
    for cid in ("ask-005", "ask-006"):
        schema = rows[cid]["body"]["text"]["format"]["schema"]
        jsonschema.validate(json.loads(output[cid].output_text), schema)
    error = json.loads((tmp_path / "res.errors.jsonl").read_text())["response"]["body"]["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", "body.tools")
