"""Every CLI failure is one line on stderr and a non-zero exit (issue 46): a local Ray that will not start
(its node timing out, as Ray's hard-coded 30 s raylet wait does on a busy host) is started again before
`run` gives up in one line; `profile` and `plan` with a model that does not load say so in one line, not
in a traceback."""

from __future__ import annotations

import json
import os

import pytest
import ray
from click.testing import CliRunner

from bulkgen.cli import cli
from bulkgen.runtime import pool
from tests.support.service import SAMPLES


def _stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.fixture
def ray_node_times_out(monkeypatch):
    """ray.init fails as Ray's node start does when its raylet does not register within 30 s."""
    if ray.is_initialized():
        pytest.skip("a Ray is running in this process")
    calls = []

    def init(*args, **kwargs):
        calls.append(kwargs)
        raise Exception(
            "The current node timed out during startup. This could happen because some of the raylet "
            "failed to startup or the GCS has become overloaded."
        )

    monkeypatch.setattr(pool.ray, "init", init)
    monkeypatch.setattr(pool.ray, "shutdown", lambda: None)
    for name in ("RAY_gcs_server_port_wait_time_s", "RAY_gcs_server_request_timeout_seconds"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def _run(tmp_path):
    out, storage = str(tmp_path / "o.jsonl"), str(tmp_path / "s")
    return CliRunner().invoke(cli, ["run", str(SAMPLES / "chat.jsonl"), "-o", out, "--storage", storage])


def test_a_local_ray_that_times_out_is_started_again_then_run_fails_in_one_line(ray_node_times_out, tmp_path):
    result = _run(tmp_path)
    assert result.exit_code == 1
    lines = _stderr_lines(result)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: cannot start a local Ray: The current node timed out during startup")
    assert len(ray_node_times_out) > 1  # started again before giving up
    assert len(ray_node_times_out) == pool.RAY_START_ATTEMPTS
    call = ray_node_times_out[0]
    assert call["_node_ip_address"] == "127.0.0.1" and call["_system_config"] == pool.RAY_SYSTEM_CONFIG
    assert os.environ["RAY_gcs_server_port_wait_time_s"] == "120"  # Ray's own wait, lengthened


def test_an_operators_own_ray_wait_wins(ray_node_times_out, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "45")
    result = _run(tmp_path)
    assert result.exit_code == 1 and os.environ["RAY_gcs_server_port_wait_time_s"] == "45"


def _broken_model(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    return folder


def test_profile_of_a_model_that_does_not_load_fails_in_one_line(tmp_path):
    folder = _broken_model(tmp_path)
    result = CliRunner().invoke(
        cli, ["profile", "--model", f"broken={folder}", "--storage", str(tmp_path / "s")]
    )
    assert result.exit_code == 1, result.output
    lines = _stderr_lines(result)
    assert len(lines) == 1 and lines[0].startswith("Error: profiling broken failed: "), result.stderr
    assert "no-such-architecture" in lines[0] and "Traceback" not in result.output


def test_plan_with_a_model_that_does_not_load_fails_in_one_line(tmp_path):
    folder = _broken_model(tmp_path)
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            str(SAMPLES / "chat.jsonl"),
            "--model",
            f"broken={folder}",
            "--storage",
            str(tmp_path / "s"),
        ],
    )
    assert result.exit_code == 1, result.output
    lines = _stderr_lines(result)
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
