"""The `serve_process` fixture: start `bulkgen serve` subprocesses, all killed when the test ends."""

from __future__ import annotations

import pytest

from tests.support.serve_process import ServeProcess


@pytest.fixture
def serve_process():
    started: list[ServeProcess] = []

    def start(storage: str, *extra: str) -> ServeProcess:
        try:
            started.append(ServeProcess(storage, *extra))
        except RuntimeError:  # Ray gives a node 30 s to start; on a loaded 2-core box try once more
            started.append(ServeProcess(storage, *extra))
        return started[-1]

    yield start
    for p in started:
        p.kill()
