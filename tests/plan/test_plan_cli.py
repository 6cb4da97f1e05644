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


def test_plan_names_a_deeply_nested_line_like_any_other(tmp_path):
    """A message nested 990 levels is its line's error (no traceback), listed with the file's own errors."""

    def row(custom_id: str, content: str) -> str:
        body = {"model": "bulkgen-tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
        return json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
        )

    deep = row("deep", "TEXT").replace('"TEXT"', "[" * 990 + "]" * 990)
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join([row("a", "hi"), deep, row("a", "again")]) + "\n")
    result = CliRunner().invoke(
        cli, ["plan", str(path), "--storage", str(tmp_path / "storage"), "--gpu", "cpu", "--json"]
    )
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    errors = [(e["line"], e["code"], e["param"]) for e in json.loads(result.output)["errors"]]
    assert errors == [(2, "invalid_parameter", "body.messages"), (3, "duplicate_custom_id", "custom_id")]


def test_plan_says_what_a_fresh_run_adds_and_when_its_profile_was_measured_on_a_busy_cpu(tmp_path):
    """The start-up and the busy warning come from the stored profile (here written as `bulkgen profile`
    would store one); the generation time stays apart from the start-up."""
    from bulkgen.plan import profile as profiles
    from bulkgen.store import open_store

    stored = profiles.Profile(
        "bulkgen-tiny", "cpu", 0.004, 1e-4, 8e-5, 1e-6, 64, 2048, 512, 16, 0.4, 0.0, 0.1, True, 12.5,
        "load average 3.2 on 2 cores",
    )  # fmt: skip
    profiles.save(open_store(str(tmp_path)), stored)
    args = ["plan", str(SAMPLES / "chat.jsonl"), "--storage", str(tmp_path), "--gpu", "cpu"]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert (plan["startup_seconds"], plan["model_load_seconds"]) == (12.5, 0.4)
    assert plan["profile"]["busy"] == "load average 3.2 on 2 cores"
    assert plan["estimated_seconds"]["expected"] < 12.5  # 22 short requests: the start-up is the larger part
    text = CliRunner().invoke(cli, args).output
    assert "~12.5 s more for a fresh `bulkgen run` (Ray, worker, model load 0.40 s)" in text
    assert "measured while the CPU was busy (load average 3.2 on 2 cores)" in text
