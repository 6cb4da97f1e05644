"""The HTTP API alone over a given store (no workers started): for tests of files, lists, errors, metrics."""

from __future__ import annotations

from bulkgen.api import create_app
from bulkgen.batch.service import BatchService
from bulkgen.runtime.manager import BatchManager
from bulkgen.settings import Settings
from tests.support.service import start_uvicorn


class ApiOnly:
    def __init__(self, store, app_options: dict | None = None, **settings) -> None:
        """`app_options`: create_app's keyword arguments (allowed_hosts, body_timeout_s)."""
        store.create()  # as `bulkgen serve` does at start, and only then
        self.svc = BatchService(Settings(storage=store.url, **settings), store=store)
        manager = BatchManager(self.svc)  # never started: batches are not run here
        self.app = create_app(self.svc, manager, **(app_options or {}))
        self.server, self.thread, port = start_uvicorn(self.app)
        self.port, self.root = port, f"http://127.0.0.1:{port}"

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.root}/v1", api_key="unused", max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
