"""Fetching an image from an http(s) URL without becoming a proxy into the operator's network (SSRF).

Only hosts the operator listed (`--image-url-hosts`) are fetched. For each hop the host name is resolved
once, every address it resolves to must be public (no private, loopback, link-local, shared, reserved or
multicast address, IPv4-mapped IPv6 included), and the connection goes to that checked address, so a name
that resolves differently a moment later (DNS rebinding) cannot move it. A redirect may only stay on the
same origin: the same host, port and scheme (or http on port 80 upgraded to https on 443, the same host);
the body is capped at the image size limit. The time limit is one wall-clock deadline over the whole
fetch, redirects included: connect, TLS, sending, the status line and headers, and the body. Socket
timeouts alone cannot hold it (a server dripping a byte every half second answers each read in time), so
at the deadline a watchdog shuts the connection's socket down and the read under way ends at once.
`Network` is the one seam: tests route a public-looking address to a server on loopback through it, since
a test server can only listen there.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

if TYPE_CHECKING:
    from bulkgen.settings import ImageSettings

MAX_REDIRECTS = 3
_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 64 * 1024


class Network:
    """How a fetch reaches a host: resolve its name, connect to one checked address."""

    def resolve(self, host: str, port: int) -> list[str]:
        return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]

    def connect(self, address: str, port: int, timeout: float) -> socket.socket:
        return socket.create_connection((address, port), timeout=timeout)


def host_allowed(url: str, hosts: tuple[str, ...]) -> bool:
    """Whether `url`'s host is one of `hosts` (`*.example.com`: any subdomain of example.com)."""
    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:
        return False
    return bool(host) and any(
        host == allowed or (allowed.startswith("*.") and host.endswith(allowed[1:])) for allowed in hosts
    )


def public(address: str) -> bool:
    """A globally routable unicast address: what a fetch may connect to."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def fetch(
    url: str, policy: ImageSettings, error: Callable[[str], Exception], network: Network | None = None
) -> bytes:
    """The body of `url` (HTTP 200 after at most MAX_REDIRECTS same-origin redirects); `error(why)` is what
    it raises for anything refused or failed."""
    network = network or Network()
    deadline = time.monotonic() + policy.image_fetch_timeout_s
    origin = urlsplit(url)
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        _check_redirect(origin, parts, error)  # the first hop is its own origin
        if parts.username is not None or parts.password is not None:
            raise error("URLs with user names or passwords are not fetched")
        status, location, body = _get(parts, policy, error, network, deadline)
        if status not in _REDIRECTS:
            if status != 200:
                raise error(f"the server answered HTTP {status}")
            return body
        if not location:
            raise error(f"the server answered HTTP {status} without a Location")
        url = urljoin(url, location)
    raise error(f"more than {MAX_REDIRECTS} redirects")


def _check_redirect(origin, target, error) -> None:
    """A redirect stays on its origin: the same host, and the same scheme and port, but for http on port 80
    upgraded to https on 443. The allow-list names hosts, so another port of an allowed host (an admin
    service beside the image server) is no more reachable by a redirect than another host."""
    try:
        scheme, port, origin_port = target.scheme.lower(), _port(target), _port(origin)
    except ValueError:
        raise error("the URL's port is not a port number") from None
    if (target.hostname or "").lower() != (origin.hostname or "").lower():
        raise error(f"redirected to another host ({target.hostname}); only same-host redirects are followed")
    if scheme not in ("http", "https"):
        raise error(f"redirected to a {scheme or 'relative'}: URL; only http(s) is fetched")
    upgrade = (origin.scheme.lower(), origin_port, scheme, port) == ("http", 80, "https", 443)
    if scheme != origin.scheme.lower() and not upgrade:
        raise error(
            f"redirected from {origin.scheme} to {scheme}; a redirect keeps its scheme (or http:80 to https:443)"
        )
    if port != origin_port and not upgrade:
        raise error(
            f"redirected to another port ({port}, from {origin_port}); only same-port redirects are followed"
        )


def _port(parts) -> int:
    return parts.port or (443 if parts.scheme.lower() == "https" else 80)


def _get(
    parts, policy: ImageSettings, error, network: Network, deadline: float
) -> tuple[int, str | None, bytes]:
    host, port = parts.hostname, _port(parts)
    address = _checked_address(host, port, error, network)
    cls = _PinnedHTTPS if parts.scheme.lower() == "https" else _PinnedHTTP
    conn = cls(host, port, timeout=_left(deadline, error))
    conn.pin(address, network, deadline)
    try:
        path = parts.path or "/"
        conn.request("GET", f"{path}?{parts.query}" if parts.query else path, headers={"Accept": "image/*"})
        response = conn.getresponse()
        if response.status in _REDIRECTS:
            return response.status, response.getheader("Location"), b""
        return response.status, None, _read_body(response, conn, policy, error, deadline)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # ValueError: a read of a closed file
        _left(deadline, error)  # the watchdog cut it: the time limit is the reason
        raise error(f"the fetch failed ({type(exc).__name__}: {exc})") from None
    finally:
        conn.close()


def _checked_address(host: str, port: int, error, network: Network) -> str:
    try:
        addresses = network.resolve(host, port)
    except OSError as exc:
        raise error(f"the host {host} does not resolve ({exc})") from None
    refused = [a for a in addresses if not public(a)]
    if refused or not addresses:
        raise error(
            f"the host {host} resolves to {refused[0] if refused else 'nothing'}, not a public address"
        )
    return addresses[0]


def _read_body(response, conn, policy: ImageSettings, error, deadline: float) -> bytes:
    limit = policy.max_image_bytes
    declared = response.getheader("Content-Length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise error(f"the image is {int(declared):,} bytes; the limit is {limit:,} (--max-image-mb)")
    chunks, size = [], 0
    while True:
        _left(deadline, error)  # a server that drips bytes is cut at the deadline
        chunk = response.read(_CHUNK)
        if not chunk:
            _left(deadline, error)  # an end of the body the watchdog made is no image
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise error(f"the image is over the limit of {limit:,} bytes (--max-image-mb)")
        chunks.append(chunk)


def _left(deadline: float, error) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the fetch took longer than the time limit (--image-fetch-timeout)")
    return left


class _Pinned:
    """A connection to one checked address; the Host header (and the TLS name) stay the URL's host. Its
    socket is shut down at the fetch's deadline (`_Watchdog`), whatever read or write is under way."""

    def pin(self, address: str, network: Network, deadline: float) -> None:
        self._address, self._network, self._deadline = address, network, deadline
        self._watchdog: _Watchdog | None = None

    def _dial(self) -> socket.socket:
        sock = self._network.connect(self._address, self.port, max(0.001, self._deadline - time.monotonic()))
        self._watchdog = _Watchdog(sock, self._deadline)
        return sock

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        super().close()


class _Watchdog:
    """Shuts `sock` down at `deadline` (a monotonic time) unless cancelled first: a blocked recv or send
    returns at once, so a slow server cannot hold a fetch (or a decoding thread) past its time limit."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._cut, (sock,))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _cut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass

    def cancel(self) -> None:
        self._timer.cancel()


class _PinnedHTTP(_Pinned, http.client.HTTPConnection):
    def connect(self) -> None:
        self.sock = self._dial()


class _PinnedHTTPS(_Pinned, http.client.HTTPSConnection):
    def connect(self) -> None:
        self.sock = self._context.wrap_socket(self._dial(), server_hostname=self.host)
