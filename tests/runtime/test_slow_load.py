"""A worker still loading its model is alive, not lost (issue 46): `bulkgen run` with a model whose load
takes 30 s (BULKGEN_TEST_LOAD_DELAY_S slows the real loader's tensor reads: engine/model/load_progress.py), six
times its 5 s --worker-poll-deadline (issue 46's was 90 s: the rule is the same at any multiple), loads the model once, replaces no worker and writes every line exactly once; a
load that outlasts its own deadline (--model-load-deadline, scaled by the checkpoint's size) fails the
batch with one line naming that deadline and the checkpoint's size.

Each run is a fresh `bulkgen run` process with its own private Ray, so its workers inherit the delay.
Loads are counted by the tests' engine class (tests/support/held_engine.py), which records each one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bulkgen.engine.model.load_progress import LOAD_DELAY_ENV

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "chat.jsonl"
LOADS = Path(os.environ["BULKGEN_TEST_GATE"]) / "loads"
POLL_DEADLINE_S = 5  # above a poll's answer on a busy host once the model runs
LOAD_S = 6 * POLL_DEADLINE_S  # six polls' deadlines in a row unanswered by a finished load


def _loads() -> int:
    return len(LOADS.read_text().splitlines()) if LOADS.exists() else 0


def _run(tmp_path: Path, delay_s: float, *flags: str, timeout: float = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "", LOAD_DELAY_ENV: str(delay_s)}
    command = [sys.executable, "-m", "bulkgen", "run", str(SAMPLE), "-o", str(tmp_path / "out.jsonl")]
    command += ["--storage", str(tmp_path / "store"), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


def test_a_worker_loading_for_six_poll_deadlines_is_not_lost_and_every_line_is_written_once(tmp_path):
    before = _loads()
    started = time.monotonic()
    proc = _run(tmp_path, LOAD_S, "--worker-poll-deadline", str(POLL_DEADLINE_S))
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lost" not in proc.stderr and "replaced" not in proc.stderr, proc.stderr
    assert _loads() - before == 1, LOADS.read_text()  # one load: the worker was never killed and restarted
    assert took >= LOAD_S, took  # the load really took its 30 s
    ids = [json.loads(line)["custom_id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    expected = [json.loads(line)["custom_id"] for line in SAMPLE.read_text().splitlines() if line.strip()]
    assert sorted(ids) == sorted(expected) and len(set(ids)) == len(ids)  # every line, exactly once
    assert f"{len(expected)} completed, 0 failed" in proc.stdout


def test_a_load_that_hangs_past_its_deadline_fails_with_one_line_naming_it(tmp_path):
    proc = _run(
        tmp_path,
        3600,  # no end in sight: a hung load
        "--worker-poll-deadline",
        "5",
        "--model-load-deadline",
        "40",  # above a worker's start on a busy host (a process that imports torch: 10-30 s)
        "--model-load-seconds-per-gb",
        "1000",
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1, proc.stderr
    assert "did not load within its deadline of 48.0 s" in error[0], error[0]  # 40 s + 1000 s/GB x 8 MB
    assert "8.0 MB checkpoint" in error[0] and "--model-load-deadline" in error[0], error[0]
