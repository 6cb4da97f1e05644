"""What each test costs the machine, for finding where the suite's time goes: with `BULKGEN_TEST_CPU=FILE`
set, every test's wall seconds and the machine's busy CPU seconds while it ran (all processes: the test's
Ray workers, servers and subprocesses included, which a per-process count misses) are appended to FILE
as tab-separated lines `nodeid wall cpu`, setup and teardown included. On a quiet machine the CPU column is
the test's own; `python -m tests.support.cpu_account FILE` prints the heaviest tests and files.

    BULKGEN_TEST_CPU=/tmp/cpu.tsv python -m pytest -q
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

ENV = "BULKGEN_TEST_CPU"
_TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """The machine's busy CPU seconds since boot (every core), from /proc/stat: all but idle and iowait."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(f) for f in fields[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK


@contextmanager
def accounted(nodeid: str, path: str):
    wall, cpu = time.monotonic(), busy_seconds()
    try:
        yield
    finally:
        line = f"{nodeid}\t{time.monotonic() - wall:.2f}\t{busy_seconds() - cpu:.2f}\n"
        with open(path, "a") as out:
            out.write(line)


def report(path: str, top: int = 40) -> str:
    rows = []
    for line in Path(path).read_text().splitlines():
        nodeid, wall, cpu = line.rsplit("\t", 2)
        rows.append((nodeid, float(wall), float(cpu)))
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, wall, cpu in rows:
        f = files[nodeid.split("::", 1)[0]]
        f[0], f[1], f[2] = f[0] + wall, f[1] + cpu, f[2] + 1
    wall_total, cpu_total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    out = [
        f"{len(rows)} tests: {wall_total:.0f} s wall, {cpu_total:.0f} CPU-s (every core)",
        "",
        "tests by wall:",
    ]
    out += [f"{w:8.1f} s {c:8.1f} CPU-s  {n}" for n, w, c in sorted(rows, key=lambda r: -r[1])[:top]]
    out += ["", "files by wall:"]
    ranked = sorted(files.items(), key=lambda kv: -kv[1][0])[:top]
    out += [f"{w:8.1f} s {c:8.1f} CPU-s {int(k):4d} tests  {f}" for f, (w, c, k) in ranked]
    return "\n".join(out)


if __name__ == "__main__":
    print(report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40))
