"""The API process and the command line's help load no torch: they are what every user starts, and the
model's side (torch, transformers) belongs to the workers. The layer contracts themselves are import-linter's
(pyproject.toml [tool.importlinter], run by .ci/run); this checks what is imported at run time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "ray")

PROBE = """
import json, sys, time
started = time.perf_counter()
{statement}
seconds = time.perf_counter() - started
rss_kb = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
print(json.dumps({{"loaded": [m for m in {heavy!r} if m in sys.modules], "s": seconds, "rss_mb": rss_kb // 1024}}))
"""


def _probe(statement: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = PROBE.format(statement=statement, heavy=HEAVY)
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_importing_the_api_app_loads_no_torch():
    found = _probe("import bulkgen.api.app")
    print(f"import bulkgen.api.app: {found}")
    assert found["loaded"] == [], found


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["serve", "--help"], ["plan", "--help"]])
def test_the_command_lines_help_loads_no_torch(args):
    statement = (
        "from click.testing import CliRunner\nimport bulkgen.cli\n"
        f"result = CliRunner().invoke(bulkgen.cli.cli, {args!r})\nassert result.exit_code == 0, result.output"
    )
    found = _probe(statement)
    print(f"bulkgen {' '.join(args)}: {found}")
    assert found["loaded"] == [], found
