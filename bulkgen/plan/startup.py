"""What a fresh `bulkgen run` costs beyond its generation: the start-up `bulkgen plan` prints apart.

A user times the whole command: the interpreter and its imports, a private local Ray, the worker actor
(a process of its own that imports torch), the model load, validation beside them, and at the end the
results written and Ray stopped. None of it is in the plan's generation time (`metrics.wall_time_s`,
what a running service's user waits for), and the parts overlap (the file is validated while Ray
starts), so it is measured whole, the one way that counts them all: a one-request `bulkgen run` of the
model, timed from outside, minus its own generation time. A large file adds its validation and its
results to this (about as much as `bulkgen plan`'s reading of it, and a few seconds per 100 MB written).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN_TIMEOUT_S = 600


def run_startup_seconds(model: str, path: str) -> float:
    """Seconds of a one-request `bulkgen run` of `model` (at `path`) outside its generation, on its own
    storage and a private local Ray (RAY_ADDRESS dropped: a cluster's workers could not read the run's
    temporary storage)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with tempfile.TemporaryDirectory(prefix="bulkgen-startup-") as tmp:
        requests, output = Path(tmp) / "one.jsonl", Path(tmp) / "one.out.jsonl"
        body = {"model": model, "prompt": "Hello", "max_tokens": 1}
        line = {"custom_id": "startup", "method": "POST", "url": "/v1/completions", "body": body}
        requests.write_text(json.dumps(line) + "\n")
        command = [sys.executable, "-m", "bulkgen", "run", str(requests), "--output", str(output)]
        command += ["--storage", str(Path(tmp) / "storage"), "--model", f"{model}={path}"]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
        total = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"timing the start-up of `bulkgen run` failed: {failure_line(done.stderr)}")
        metrics = json.loads(output.with_name("one.out.metrics.json").read_text())
    return round(max(0.0, total - metrics["wall_time_s"]), 2)


def failure_line(stderr: str) -> str:
    """What a failed subprocess said, in one line: its last line (a command's `Error: …`, a traceback's
    exception), without click's `Error: ` prefix."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1].removeprefix("Error: ") if lines else "no message"
