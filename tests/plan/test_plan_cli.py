"""`bulkgen plan` and `bulkgen profile` through the CLI: invalid files, devices without a profile, the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from bulkgen.cli import cli

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def test_plan_lists_every_validation_error_with_its_line(tmp_path):
    result = CliRunner().invoke(
        cli, ["plan", str(SAMPLES / "invalid.jsonl"), "--storage", str(tmp_path), "--gpu", "cpu", "--json"]
    )
    assert result.exit_code == 1, result.output
    plan = json.loads(result.output)
    assert plan["valid"] is False
    assert [(e["line"], e["code"]) for e in plan["errors"]] == [
        (2, "duplicate_custom_id"),
        (3, "invalid_json_line"),
        (4, "missing_custom_id"),
        (5, "url_mismatch"),
        (6, "model_mismatch"),
    ]


def test_plan_for_a_device_without_a_profile_says_so(tmp_path):
    result = CliRunner().invoke(
        cli, ["plan", str(SAMPLES / "chat.jsonl"), "--storage", str(tmp_path), "--gpu", "h200"]
    )
    assert result.exit_code == 1
    assert "no profile of bulkgen-tiny exists for device 'h200' (stored: none)" in result.output
