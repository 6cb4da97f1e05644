"""`bulkgen serve` as a real subprocess on 127.0.0.1, for the tests that kill or double the service."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

from tests.support.service import free_port, kill_process_group
from tests.support.wait import wait_until


class ServeProcess:
    def __init__(self, storage: str, *extra: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        cmd = [
            sys.executable,
            "-m",
            "bulkgen",
            "serve",
            "--storage",
            storage,
            "--port",
            str(self.port),
            "--range-size",
            "16",
            *extra,
        ]
        self.log = open(f"{storage}.serve-{self.port}.log", "wb")
        # its own session, so a SIGKILL reaches the whole process group (the service and its local Ray)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # a process that imports torch and starts its own Ray: a minute and more on 2 loaded cores (Ray's
            # own start waits up to 120 s there, RAY_START_WAITS); an exit fails at once
            wait_until(
                self._healthy, 300, f"bulkgen serve on port {self.port}", interval=0.1, check=self._running
            )
        except AssertionError:
            self.kill()
            raise RuntimeError(f"bulkgen serve did not start; see {self.log.name}") from None

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _running(self) -> None:
        assert self.proc.poll() is None, f"bulkgen serve exited with {self.proc.returncode}"

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=2, timeout=60)

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, as when a node or pod dies."""
        kill_process_group(self.proc)
        self.log.close()
