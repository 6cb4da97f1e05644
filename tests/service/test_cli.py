"""The CLI, through click's CliRunner against a real server, and as a subprocess like a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from bulkgen.cli import cli
from tests.models.english import looks_like_english
from tests.support.held_engine import HOLD
from tests.support.service import SAMPLES, chat_row, random_model, wait_done, wait_for, write_jsonl


def _invoke(service, *args):
    result = CliRunner().invoke(cli, [*args, "--base-url", service.base_url, "--api-key", "k"])
    return result


def test_submit_wait_downloads_results(service, tmp_path):
    out = tmp_path / "out" / "chat.jsonl"
    result = _invoke(
        service,
        "submit",
        str(SAMPLES / "chat.jsonl"),
        "--wait",
        "--output",
        str(out),
        "--metadata",
        "owner=cli",
    )
    assert result.exit_code == 0, result.output
    assert "completed: 22 completed, 0 failed" in result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 22 and not (tmp_path / "out" / "chat.errors.jsonl").exists()
    batch_id = result.output.split()[0]

    status = _invoke(service, "status", batch_id, "--metrics")
    assert status.exit_code == 0 and "completed  22/22 completed, 0 failed" in status.output
    assert "slot efficiency" in status.output and "TTFT p50/p95/p99 (ms)" in status.output
    health = re.search(r"answers: 22 \(([^)]*)\); (.*)", status.output)  # the output health line
    assert health and sum(int(n) for n in re.findall(r"\d+", health[1])) == 22, status.output
    listed = _invoke(service, "list", "--limit", "5")
    assert batch_id in listed.output
    again = tmp_path / "again.jsonl"
    fetched = _invoke(service, "results", batch_id, "--output", str(again))
    assert fetched.exit_code == 0 and again.read_text().count("\n") == 22


def test_submit_invalid_file_shows_lines_and_fails(service):
    result = _invoke(service, "submit", str(SAMPLES / "invalid.jsonl"))
    assert result.exit_code == 1
    assert "line 3: [invalid_json_line]" in result.output and "Traceback" not in result.output


def test_client_errors_are_one_line(service, tmp_path):
    missing = _invoke(service, "status", "batch_nope")
    assert missing.exit_code == 1 and "404" in missing.output and "Traceback" not in missing.output
    no_server = CliRunner().invoke(cli, ["list", "--base-url", "http://127.0.0.1:9/v1"])
    assert no_server.exit_code == 1 and "cannot reach the server" in no_server.output
    not_jsonl = tmp_path / "notes.txt"
    not_jsonl.write_text("hello\n")
    bad = _invoke(service, "submit", str(not_jsonl))
    assert bad.exit_code == 1 and "notes.txt:1" in bad.output


def test_cancel_command(service, tmp_path, engine_gate):
    rows = [chat_row(f"long-{i}", f"{HOLD} x", max_tokens=64) for i in range(4)]  # held until cancelled
    submitted = _invoke(service, "submit", str(write_jsonl(tmp_path / "c.jsonl", rows)))
    batch_id = submitted.output.split()[0]
    result = _invoke(service, "cancel", batch_id)
    assert result.exit_code == 0 and result.output.split()[1] in ("cancelling", "cancelled")
    assert wait_done(service.client(), batch_id, timeout=60).status == "cancelled"


def test_run_one_shot_in_process(tmp_path):
    """In-process `bulkgen run` with the trained default model, on the Ray workers this session's service
    already runs with a random model under the same name: the worker keys models by name and path.
    As a tenant, its records and results are stored under that tenant's folder."""
    out = tmp_path / "res.jsonl"
    result = CliRunner().invoke(
        cli,
        [
            "run",
            str(SAMPLES / "completions.jsonl"),
            "--output",
            str(out),
            "--storage",
            str(tmp_path / "store"),
            "--tenant",
            "team-x",
        ],
    )
    assert result.exit_code == 0, result.output
    assert list((tmp_path / "store" / "tenants" / "team-x" / "batches").glob("batch_*.json"))
    assert not (tmp_path / "store" / "batches").exists()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 10
    assert sum(looks_like_english(x["response"]["body"]["choices"][0]["text"]) for x in lines) >= 7
    assert json.loads((tmp_path / "res.metrics.json").read_text())["requests"] == 10


def test_run_fails_when_no_request_succeeded(tmp_path, monkeypatch):
    monkeypatch.setenv("BULKGEN_DEFAULT_MODEL", str(random_model()))
    rows = [
        {
            "custom_id": f"big-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "bulkgen-tiny", "prompt": "x", "max_tokens": 1_000_000},
        }
        for i in range(3)
    ]
    result = CliRunner().invoke(
        cli,
        [
            "run",
            str(write_jsonl(tmp_path / "big.jsonl", rows)),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--storage",
            str(tmp_path / "store"),
        ],
    )
    assert result.exit_code == 1 and "no request succeeded: all 3 are in the error file" in result.output
    assert len((tmp_path / "o.errors.jsonl").read_text().splitlines()) == 3


def test_run_invalid_file_names_file_and_line(tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "run",
            str(SAMPLES / "invalid.jsonl"),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--storage",
            str(tmp_path / "store"),
        ],
    )
    assert result.exit_code == 1 and "invalid.jsonl:3: [invalid_json_line]" in result.output


@pytest.mark.slow
def test_run_as_subprocess(tmp_path):
    """What a new user types: a fresh process that starts its own Ray."""
    out = tmp_path / "chat.jsonl"
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bulkgen",
            "run",
            str(SAMPLES / "chat.jsonl"),
            "-o",
            str(out),
            "--storage",
            str(tmp_path / "store"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "22 completed, 0 failed" in proc.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 22
    texts = [line["response"]["body"]["choices"][0]["message"]["content"] for line in lines]
    assert sum(looks_like_english(t) for t in texts) >= 18, texts  # the bundled trained model, not noise


def test_status_shows_time_left_while_running(service, tmp_path, engine_gate):
    rows = [
        chat_row(f"held-{i}", f"{HOLD} item {i}", max_tokens=64) for i in range(16)
    ]  # running when cancelled
    rows += [
        chat_row(f"eta-{i}", f"item {i}", max_tokens=8) for i in range(32)
    ]  # the ETA is measured on these
    submitted = _invoke(service, "submit", str(write_jsonl(tmp_path / "eta.jsonl", rows)))
    batch_id = submitted.output.split()[0]
    client = service.client()
    wait_for(client, batch_id, lambda b: (b.model_extra.get("metrics") or {}).get("eta_s"))
    shown = _invoke(service, "status", batch_id).output
    client.batches.cancel(batch_id)
    assert "in_progress" in shown and " left" in shown, shown
    wait_done(client, batch_id)
