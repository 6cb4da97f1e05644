"""`bulkgen serve` as a real subprocess on 127.0.0.1, for the tests that kill or double the service."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.service.conftest import free_port, kill_process_group


class ServeProcess:
    def __init__(self, storage: str, *extra: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        cmd = [sys.executable, "-m", "bulkgen", "serve", "--storage", storage, "--port", str(self.port),
               "--range-size", "16", *extra]
        self.log = open(f"{storage}.serve-{self.port}.log", "wb")
        # its own session, so a SIGKILL reaches the whole process group (the service and its local Ray)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"bulkgen serve did not start; see {self.log.name}")
            time.sleep(0.3)

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=2, timeout=60)

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, as when a node or pod dies."""
        kill_process_group(self.proc)
        self.log.close()


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
