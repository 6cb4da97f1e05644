"""The `watch_process` fixture: start `bulkgen watch` subprocesses, all killed when the test ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.watch import WatchProcess


@pytest.fixture
def watch_process():
    started: list[WatchProcess] = []

    def start(log_path: Path, *args: str, env: dict | None = None) -> WatchProcess:
        started.append(WatchProcess(log_path, *args, env=env))
        return started[-1]

    yield start
    for p in started:
        p.kill()
