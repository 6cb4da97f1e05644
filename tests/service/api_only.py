"""The HTTP API alone over a given store (no workers started): for tests of files, lists, errors, metrics."""

from __future__ import annotations

import threading
import time

import uvicorn

from bulkgen.api import create_app
from bulkgen.batch.service import BatchService
from bulkgen.runtime.manager import BatchManager
from bulkgen.settings import Settings
from tests.service.conftest import free_port


class ApiOnly:
    def __init__(self, store, **settings) -> None:
        self.svc = BatchService(Settings(storage=store.url, **settings), store=store)
        manager = BatchManager(self.svc)  # never started: batches are not run here
        port = free_port()
        self.app = create_app(self.svc, manager)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.root = f"http://127.0.0.1:{port}"

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.root}/v1", api_key="unused", max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
