"""http(s) image URLs and SSRF: a URL is fetched only on a host the operator allowed, only from public
addresses (checked for the address connected to, hop by hop), with same-host redirects, a size cap and a
time limit.

The image server listens on 127.0.0.1, the only address a test may use, and loopback is exactly what the
guard refuses. So the test's `Network` (the fetcher's one seam: resolve a name, connect to an address)
resolves the made-up host `images.example` to the public address 93.184.216.34 and routes connections to
that one address to the local server; the guard sees and checks the public address, as it would in
production. Every other name and address goes to the real resolver and socket.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bulkgen.batch.image_fetch import Network, host_allowed, public
from bulkgen.batch.images import ImageError, ImageRef, check_images, load_images
from bulkgen.settings import ImageSettings, parse_hosts
from tests.support.images import image_bytes

PUBLIC = "93.184.216.34"
PNG = image_bytes("PNG", (6, 4), (0, 0, 200))
P = "body.messages[0].content[1].image_url"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        routes = {
            "/cat.png": (200, {"Content-Type": "image/png", "Content-Length": str(len(PNG))}, PNG),
            "/to-loopback": (
                302,
                {"Location": f"http://127.0.0.1:{port}/cat.png", "Content-Length": "0"},
                b"",
            ),
            "/to-same-host": (302, {"Location": "/cat.png", "Content-Length": "0"}, b""),
            "/to-other-port": (
                302,
                {"Location": f"http://images.example:{port + 1}/cat.png", "Content-Length": "0"},
                b"",
            ),
            "/to-https": (
                302,
                {"Location": f"https://images.example:{port}/cat.png", "Content-Length": "0"},
                b"",
            ),
            "/to-ftp": (302, {"Location": "ftp://images.example/cat.png", "Content-Length": "0"}, b""),
            "/big": (200, {"Content-Length": str(len(PNG) + 5000)}, PNG + b"\0" * 5000),
            "/big-undeclared": (200, {}, PNG + b"\0" * 5000),
            "/missing": (404, {}, b""),
        }
        if self.path == "/slow":
            self.server.release.wait(10)
            return
        status, headers, body = routes[self.path]
        self.server.paths.append(self.path)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.paths, httpd.release = [], threading.Event()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()


class Routed(Network):
    """`names` resolve as given; connections to PUBLIC, on any port, go to the local server (see the module
    docstring)."""

    def __init__(self, port: int, names: dict[str, list[str]]):
        self.port, self.names, self.dialled = port, names, []

    def resolve(self, host, port):
        return list(self.names[host]) if host in self.names else super().resolve(host, port)

    def connect(self, address, port, timeout):
        self.dialled.append(address)
        if address == PUBLIC:
            return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return super().connect(address, port, timeout)


def _load(url: str, server, hosts=("images.example",), names=None, **limits):
    network = Routed(server.server_address[1], names or {"images.example": [PUBLIC]})
    policy = ImageSettings(image_url_hosts=hosts, **limits)
    return load_images([ImageRef(url, "auto", P)], store=None, policy=policy, network=network), network


def _refused(url: str, server, **kwargs) -> str:
    with pytest.raises(ImageError) as info:
        _load(url, server, **kwargs)
    assert info.value.param == P
    return info.value.message


def test_an_allowed_host_is_fetched_through_its_checked_address(server):
    (image,), network = _load("http://images.example/cat.png", server)
    assert (image.size, image.getpixel((0, 0)), network.dialled) == ((6, 4), (0, 0, 200), [PUBLIC])
    (image,), _ = _load("http://images.example/to-same-host", server)
    assert image.size == (6, 4)
    assert server.paths == ["/cat.png", "/to-same-host", "/cat.png"]


def test_a_host_not_allowed_is_refused_at_validation_and_never_fetched(server):
    ref = ImageRef("http://images.example/cat.png", "auto", P)
    with pytest.raises(ImageError, match="not on a host this service fetches images from"):
        check_images([ref], store=None, policy=ImageSettings())  # the default: no hosts
    assert "not on a host" in _refused("http://images.example/cat.png", server, hosts=("other.example",))
    assert "not on a host" in _refused("http://sub.images.example/cat.png", server)
    assert server.paths == []


def test_a_redirect_to_loopback_is_refused_even_when_loopback_is_allowed(server):
    message = _refused("http://images.example/to-loopback", server, hosts=("images.example", "127.0.0.1"))
    assert "redirected to another host (127.0.0.1)" in message
    assert server.paths == ["/to-loopback"]  # the redirect's target was never asked for


def test_private_and_loopback_addresses_are_refused_before_connecting(server):
    port = server.server_address[1]
    message = _refused(f"http://127.0.0.1:{port}/cat.png", server, hosts=("127.0.0.1",))
    assert "resolves to 127.0.0.1, not a public address" in message
    names = {"intranet.example": ["10.0.0.5"], "mixed.example": [PUBLIC, "169.254.169.254"]}
    for host in names:
        message = _refused(f"http://{host}/cat.png", server, hosts=(host,), names=names)
        assert "not a public address" in message
    assert server.paths == []


def test_a_name_that_rebinds_to_loopback_between_hops_is_refused(server):
    """Each hop resolves and checks again: a same-host redirect cannot reach an address the first hop's
    check never saw."""

    class Rebinding(Routed):
        def resolve(self, host, port):
            answer = super().resolve(host, port)
            self.names[host] = ["127.0.0.1"]  # the next lookup answers loopback
            return answer

    network = Rebinding(server.server_address[1], {"images.example": [PUBLIC]})
    policy = ImageSettings(image_url_hosts=("images.example",))
    ref = ImageRef("http://images.example/to-same-host", "auto", P)
    with pytest.raises(ImageError, match="resolves to 127.0.0.1, not a public address"):
        load_images([ref], store=None, policy=policy, network=network)
    assert (server.paths, network.dialled) == (["/to-same-host"], [PUBLIC])


def test_size_cap_time_limit_and_errors_of_the_server(server):
    too_big = _refused("http://images.example/big", server, max_image_bytes=2048)
    assert "the image is 5,077 bytes; the limit is 2,048" in too_big  # from Content-Length, before the body
    too_big = _refused("http://images.example/big-undeclared", server, max_image_bytes=2048)
    assert "over the limit of 2,048 bytes" in too_big
    assert "the server answered HTTP 404" in _refused("http://images.example/missing", server)
    message = _refused("http://images.example/slow", server, image_fetch_timeout_s=0.3)
    assert "timed out" in message or "time limit" in message


@pytest.mark.parametrize(
    "address, ok",
    [
        ("93.184.216.34", True),
        ("2606:2800:220:1:248:1893:25c8:1946", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # carrier-grade NAT
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
    ],
)
def test_public_addresses(address, ok):
    assert public(address) is ok


def test_allowed_hosts_match_whole_names_and_wildcard_subdomains():
    hosts = parse_hosts(["images.example.com,*.cdn.example", "[2606:2800::1]"])
    allowed = [
        "http://IMAGES.example.com/a.png",
        "https://x.cdn.example/a",
        "http://a.b.cdn.example/",
        "http://[2606:2800::1]:8080/a",
    ]
    refused = [
        "http://cdn.example/a",
        "http://evilcdn.example/a",
        "http://images.example.com.evil/a",
        "http://example.com/",
    ]
    assert [host_allowed(url, hosts) for url in allowed + refused] == [True] * 4 + [False] * 4


def test_a_redirect_to_another_port_or_scheme_of_the_same_host_is_refused(server):
    """The allow-list names hosts: another port of an allowed host (say an admin service beside the image
    server) or another scheme must not be reachable by redirect. The test network routes every port of the
    public address to the server, so only the check refuses these."""
    port = server.server_address[1]
    message = _refused(f"http://images.example:{port}/to-other-port", server)
    assert f"redirected to another port ({port + 1}, from {port})" in message
    message = _refused(f"http://images.example:{port}/to-https", server)
    assert "redirected from http to https" in message
    assert "redirected to a ftp: URL; only http(s) is fetched" in _refused(
        "http://images.example/to-ftp", server
    )
    assert server.paths == ["/to-other-port", "/to-https", "/to-ftp"]  # no redirect's target was asked for


class _Drip:
    """A server on loopback that answers every request one byte per `every` seconds: its status line and
    headers (`what="headers"`), or promptly its headers and then its body (`what="body"`)."""

    def __init__(self, what: str, every: float = 0.5):
        self.what, self.every, self.stop = what, every, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65536)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nX-Pad: " + b"x" * 200
            body = PNG + b"\0" * 200
            head += b"\r\nContent-Length: %d\r\n\r\n" % len(body)
            try:
                if self.what == "body":
                    conn.sendall(head)
                for byte in head + body if self.what == "headers" else body:
                    if self.stop.wait(self.every):
                        return
                    conn.sendall(bytes([byte]))
            except OSError:  # the fetch hung up
                return

    def close(self):
        self.stop.set()
        self.listener.close()


@pytest.mark.parametrize("what", ["headers", "body"])
def test_a_server_dripping_its_headers_or_body_is_cut_at_the_time_limit(what):
    """One byte every 0.5 s answers each socket read within any per-read timeout: the limit must hold over the
    whole request (before the fix a 3 s fetch of such a server ran for minutes)."""
    drip = _Drip(what)
    try:
        network = Routed(drip.port, {"images.example": [PUBLIC]})
        policy = ImageSettings(image_url_hosts=("images.example",), image_fetch_timeout_s=1.5)
        start = time.monotonic()
        with pytest.raises(ImageError, match="time limit"):
            load_images(
                [ImageRef("http://images.example/cat.png", "auto", P)],
                store=None,
                policy=policy,
                network=network,
            )
        assert time.monotonic() - start < 1.5 + 0.5
    finally:
        drip.close()
