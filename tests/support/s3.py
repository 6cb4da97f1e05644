"""S3 fault injection for tests: a real HTTP proxy in front of the moto server that fails requests as told,
and the store retry settings that keep those tests quick."""

from __future__ import annotations

import http.client
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

FAST_RETRY = {"retry_base_delay": 0.01, "retry_max_delay": 0.05}


SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
ANSWERS = {
    "503": (503, SLOW_DOWN),
    "500": (
        500,
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
        b"<Message>We encountered an internal error. Please try again.</Message></Error>",
    ),
    "403": (
        403,
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
        b"<Message>Access Denied</Message></Error>",
    ),
    "nosuchupload": (  # S3's answer to a completion retried after the upload completed (moto answers 200)
        404,
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code>'
        b"<Message>The specified upload does not exist. The upload ID may be invalid, or the upload may have "
        b"been aborted or completed.</Message></Error>",
    ),
    "badkey": (
        403,
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidAccessKeyId</Code>'
        b"<Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>",
    ),
}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host"}


RANGED_HEADERS = ("range", "x-amz-copy-source", "x-amz-copy-source-range")


class FlakyProxy:
    """A real HTTP hop in front of moto: fails the first requests as told by `fail`, then forwards.

    `fail` is a list consumed in order: "503" answers SlowDown, "500" InternalError, "drop" closes the
    connection unanswered, "lost" forwards the request (so it takes effect) but answers SlowDown, as when
    a reply is lost; `delay_s` holds every answer that long (S3's first-byte latency, for a benchmark); "403" answers AccessDenied, "badkey" InvalidAccessKeyId and "nosuchupload" NoSuchUpload. Besides, `rate` fails
    that fraction of the other requests with a mode drawn from `rate_modes` (seeded), and while `down` is
    set every request fails that way (an outage window). `aimed` fails chosen requests: a list of
    (match(method, path), mode), each used by the first request it matches, in order (mode None: forwarded
    as it is). `log` records (method, path, status).
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = urlparse(upstream)
        self.fail: list[str] = []
        self.aimed: list[tuple[Callable[[str, str], bool], str | None]] = []
        self.rate, self.rate_modes, self.down = 0.0, ("503", "500", "drop", "lost"), None
        self.delay_s = 0.0
        self.random = random.Random(1234)
        self.log: list[tuple[str, str, int]] = []
        self.ranged: list[tuple[str, str, dict]] = []  # (method, path, RANGED_HEADERS it carries) of each
        # request that carries one (a ranged GET, a copy): which bytes it read or copied
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def _next_failure(self, method: str, path: str) -> str | None:
        with self.lock:
            for i, (match, mode) in enumerate(self.aimed):
                if match(method, path):
                    del self.aimed[i]
                    return mode
            if self.fail:
                return self.fail.pop(0)
            if self.down:
                return self.down
            if self.rate and self.random.random() < self.rate:
                return self.random.choice(self.rate_modes)
            return None

    def _forward(self, handler: BaseHTTPRequestHandler) -> tuple[int, list[tuple[str, str]], bytes]:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_BY_HOP}
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=30)
        try:
            conn.request(handler.command, handler.path, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            conn.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _serve(self) -> None:
                time.sleep(proxy.delay_s)
                if found := {h: self.headers[h] for h in RANGED_HEADERS if h in self.headers}:
                    proxy.ranged.append((self.command, self.path, found))
                failure = proxy._next_failure(self.command, self.path)
                if failure == "drop":
                    proxy.log.append((self.command, self.path, 0))
                    self.close_connection = True
                    return
                if failure in ANSWERS:
                    status, body = ANSWERS[failure]
                    headers = [("Content-Type", "application/xml")]
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                else:
                    status, headers, body = proxy._forward(self)
                    if failure == "lost":
                        status, headers, body = 503, [("Content-Type", "application/xml")], SLOW_DOWN
                proxy.log.append((self.command, self.path, status))
                self.send_response(status)
                head = self.command == "HEAD"  # a HEAD answer keeps the object's own Content-Length
                for name, value in headers:
                    if name.lower() not in HOP_BY_HOP and (head or name.lower() != "content-length"):
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _serve

        return Handler


def request_class(method: str, path: str) -> str:
    """'put' (PUT, POST, COPY), 'list', 'get' (GET, HEAD), 'delete' (free on S3), or 'lease' (a lease's
    renewal: one per ttl/3 of a batch's run, by design), of one logged request."""
    if "/leases/" in path:
        return "lease"
    if method in ("PUT", "POST"):
        return "put"
    if method == "GET" and ("list-type=" in path or "/" not in path.split("?")[0].strip("/")):
        return "list"
    return {"GET": "get", "HEAD": "get", "DELETE": "delete"}[method]


def tally(log: list) -> Counter:
    return Counter(request_class(method, path) for method, path, _ in log)
