"""Where the machine's CPU time went while a benchmark ran: every process, and the engine worker's threads.

A sampler thread reads /proc every 0.2 s (Linux only; no psutil needed). Afterwards `window(t0, t1)` gives
the CPU seconds each process group spent between two wall-clock times, so a benchmark can account for
the generation phase alone: the engine thread, the worker's other threads, the driver, Ray's own daemons,
and everything else on the machine (which says whether it was quiet).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(stat_path: Path) -> tuple[str, int, float] | None:
    """(name, parent pid, CPU seconds: utime + stime) of a process or thread."""
    try:
        text = stat_path.read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def group_of(name: str, cmdline: str, mine: bool) -> str:
    """A process's group in the account: an engine worker, Ray's daemons (of this run), the driver,
    or anything else on the machine."""
    if not mine:
        return "not this run"
    if "EngineWorker" in cmdline or "bulkgen-wo" in name:
        return "engine worker"
    if "ray" in cmdline or name in ("raylet", "gcs_server"):
        return "ray daemons"
    return "other processes of this run"


class CpuAccount:
    """Samples cumulative CPU time per process (and per thread of engine workers) with timestamps."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []  # (time.time(), key -> cumulative CPU s)
        self._me = os.getpid()
        self._labels: dict[tuple[int, str], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-account", daemon=True)

    def __enter__(self) -> CpuAccount:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._snapshot()))
            self._stop.wait(self.interval_s)
        self.samples.append((time.time(), self._snapshot()))

    def _snapshot(self) -> dict[str, float]:
        stats = {
            int(p.name): got
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and (got := _stat(p / "stat")) is not None
        }
        out: dict[str, float] = {}
        for pid, (name, _, cpu) in stats.items():
            if (pid, name) not in self._labels:  # a Ray worker renames itself when it becomes an actor
                mine = pid == self._me or self._descends(pid, stats)
                label = (
                    "driver (this process)" if pid == self._me else group_of(name, _cmdline(str(pid)), mine)
                )
                self._labels[pid, name] = label
            group = self._labels[pid, name]
            if group == "engine worker":
                for task in Path(f"/proc/{pid}/task").iterdir():
                    thread = _stat(task / "stat")
                    if thread is not None:
                        out[f"engine worker|{thread[0]}|{task.name}"] = thread[2]
            else:
                out[f"{group}|{pid}"] = cpu
        return out

    def _descends(self, pid: int, stats: dict) -> bool:
        seen = set()
        while pid in stats and pid not in seen and pid > 1:
            seen.add(pid)
            pid = stats[pid][1]
            if pid == self._me:
                return True
        return False

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per group (engine worker threads by name) between wall-clock times t0 and t1."""
        before = max((s for s in self.samples if s[0] <= t0), default=self.samples[0], key=lambda s: s[0])[1]
        after = min((s for s in self.samples if s[0] >= t1), default=self.samples[-1], key=lambda s: s[0])[1]
        groups: dict[str, float] = {}
        for key, cpu in after.items():
            parts = key.split("|")
            label = f"worker thread {parts[1]}" if parts[0] == "engine worker" else parts[0]
            groups[label] = groups.get(label, 0.0) + cpu - before.get(key, 0.0)
        return {k: round(v, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v >= 0.005}
