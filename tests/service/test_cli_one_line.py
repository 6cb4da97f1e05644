"""Every CLI failure is one line on stderr and a non-zero exit (issue 46): a local Ray that will not start
(its node timing out, as Ray's hard-coded 30 s raylet wait does on a busy host) is started again before
`run` gives up in one line; `profile` and `plan` with a model that does not load say so in one line, not
in a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from bulkgen.cli import cli
from tests.support.service import SAMPLES


def _stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


# `bulkgen run` in a process of its own (this one may hold the suite's Ray), with ray.init failing as Ray's
# node start does when its raylet does not register within 30 s
_TIMED_OUT_RUN = """
import json, os, sys
from click.testing import CliRunner
from bulkgen.runtime import pool
calls = []
def init(*args, **kwargs):
    calls.append({"ip": kwargs.get("_node_ip_address"), "config": kwargs.get("_system_config") == pool.RAY_SYSTEM_CONFIG})
    raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")
pool.ray.init, pool.ray.shutdown = init, lambda: None
from bulkgen.cli import cli
result = CliRunner().invoke(cli, sys.argv[1:])
print(json.dumps({"exit": result.exit_code, "stderr": result.stderr, "calls": calls,
                  "attempts": pool.RAY_START_ATTEMPTS, "wait": os.environ.get("RAY_gcs_server_port_wait_time_s")}))
"""


def _run_with_ray_timing_out(tmp_path, **env) -> dict:
    out, storage = str(tmp_path / "o.jsonl"), str(tmp_path / "s")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _TIMED_OUT_RUN,
            "run",
            str(SAMPLES / "chat.jsonl"),
            "-o",
            out,
            "--storage",
            storage,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**clean, **env},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_local_ray_that_times_out_is_started_again_then_run_fails_in_one_line(tmp_path):
    result = _run_with_ray_timing_out(tmp_path)
    assert result["exit"] == 1
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    assert errors == lines[-1:] and "Traceback" not in result["stderr"], result["stderr"]
    assert lines[-1].startswith("Error: cannot start a local Ray: The current node timed out during startup")
    # before it, one line a new start says (the log's warning), nothing else
    assert [line for line in lines[:-1] if "starting it again" not in line] == [], result["stderr"]
    assert len(lines) - 1 == result["attempts"] - 1
    assert len(result["calls"]) > 1  # started again before giving up
    assert len(result["calls"]) == result["attempts"]
    assert result["calls"][0] == {"ip": "127.0.0.1", "config": True}
    assert result["wait"] == "120"  # Ray's own wait, lengthened


def test_an_operators_own_ray_wait_wins(tmp_path):
    result = _run_with_ray_timing_out(tmp_path, RAY_gcs_server_port_wait_time_s="45")
    assert result["exit"] == 1 and result["wait"] == "45"


def _broken_model(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    return folder


@pytest.mark.subprocess  # `bulkgen profile` measures in a child process
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
