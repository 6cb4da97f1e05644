"""`bulkgen watch` as a real subprocess (its own session, so SIGKILL takes its local Ray down with it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.service import MODEL, kill_process_group, random_model
from tests.support.wait import wait_until as support_wait

ROOT = Path(__file__).resolve().parents[2]
FAST_ENGINE = ("--range-size", "16", "--max-num-seqs", "64", "--max-num-batched-tokens", "1024")


class WatchProcess:
    def __init__(self, log_path: Path, *args: str, env: dict | None = None) -> None:
        cmd = [
            sys.executable,
            "-m",
            "bulkgen",
            "watch",
            "--model",
            f"{MODEL}={random_model()}",
            *FAST_ENGINE,
            *args,
        ]
        self.log_path = log_path
        self.log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=full_env,
            cwd=log_path.parent,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_log(self, needle: str, timeout: float = 120) -> None:
        wait_until(lambda: needle in self.text(), timeout, f"{needle!r} in {self.log_path}", self)

    def kill(self) -> None:
        """SIGKILL, as when a node dies: no cleanup runs."""
        kill_process_group(self.proc)
        self.log.close()


def wait_until(predicate, timeout: float, what: str, *watchers: WatchProcess):
    """`predicate`'s first truthy value; fails at once, with its log, if a watcher dies meanwhile."""

    def alive() -> None:
        for w in watchers:
            assert w.alive(), f"watcher died while waiting for {what}:\n{w.text()[-3000:]}"

    return support_wait(
        predicate,
        timeout,
        what,
        interval=0.1,
        check=alive,
        details=lambda: "\n".join(w.text()[-3000:] for w in watchers),
    )


def rows_jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()
