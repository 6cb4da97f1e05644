"""A real webhook receiver on 127.0.0.1 that verifies every event with the official `openai` package."""

from __future__ import annotations

import base64
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai

from tests.support.wait import wait_until

SECRET = "whsec_" + base64.b64encode(b"bulkgen-test-webhook-secret-0123").decode()


class Receiver:
    """Answers each POST with the next status of `answers` (then 200); keeps every request it got and
    every event that `openai`'s webhooks.unwrap accepted (a 2xx answer only)."""

    def __init__(self, answers: list[int] = (), secret: str = SECRET) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[bytes, dict]] = []
        self.events: list = []
        self.rejected: list[str] = []
        self._lock = threading.Lock()
        verifier = openai.OpenAI(api_key="x", webhook_secret=secret, base_url="http://127.0.0.1:9/v1")
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver._lock:
                    receiver.requests.append((body, headers))
                    status = receiver.answers.pop(0) if receiver.answers else 200
                    if status < 300:
                        try:
                            receiver.events.append(verifier.webhooks.unwrap(body, headers))
                        except Exception as exc:  # a bad signature: a receiver answers 400
                            receiver.rejected.append(repr(exc))
                            status = 400
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/bulkgen"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_events(self, count: int, timeout: float = 30.0) -> list:
        wait_until(
            lambda: len(self.events) >= count,
            timeout,
            f"{count} events",
            details=lambda: f"got {len(self.events)}: {self.requests}",
        )
        return self.events

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SilentReceiver:
    """Accepts connections (the kernel's backlog does) and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hooks"

    def close(self) -> None:
        self.sock.close()
