"""A measurement in a fresh interpreter: tracemalloc (and RSS) count every thread of a process, and a test
process has other tests' threads (a service's manager, an S3 server) allocating beside the code measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure_fresh(module: str, function: str, timeout: float = 300) -> dict:
    """`module.function()` (which returns a JSON-able dict) run in a new interpreter in the repository root."""
    code = f"import json; from {module} import {function}; print(json.dumps({function}()))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
