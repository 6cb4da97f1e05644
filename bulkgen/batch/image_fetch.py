"""Fetching an image from an http(s) URL without becoming a proxy into the operator's network (SSRF).

Only hosts the operator listed (`--image-url-hosts`) are fetched. For each hop the host name is resolved
once, every address it resolves to must be public (no private, loopback, link-local, shared, reserved or
multicast address, IPv4-mapped IPv6 included), and the connection goes to that checked address, so a name
that resolves differently a moment later (DNS rebinding) cannot move it. A redirect may only stay on the
same host (never from https to http); the body is capped at the image size limit, and the time limit
holds for the whole fetch, redirects included (no connection or read starts after it, and each socket
wait is bounded by the time left when its hop began). `Network` is the one seam: tests route a public-looking address to
a server on loopback through it, since a test server can only listen there.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
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
    """The body of `url` (HTTP 200 after at most MAX_REDIRECTS same-host redirects); `error(why)` is what
    it raises for anything refused or failed."""
    network = network or Network()
    deadline = time.monotonic() + policy.image_fetch_timeout_s
    origin = urlsplit(url)
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if (parts.hostname or "").lower() != (origin.hostname or "").lower():
            raise error(
                f"redirected to another host ({parts.hostname}); only same-host redirects are followed"
            )
        if origin.scheme == "https" and parts.scheme != "https":
            raise error("redirected from https to http")
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


def _get(
    parts, policy: ImageSettings, error, network: Network, deadline: float
) -> tuple[int, str | None, bytes]:
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    address = _checked_address(host, port, error, network)
    cls = _PinnedHTTPS if parts.scheme == "https" else _PinnedHTTP
    conn = cls(host, port, timeout=_left(deadline, error))
    conn.pin(address, network)
    try:
        path = parts.path or "/"
        conn.request("GET", f"{path}?{parts.query}" if parts.query else path, headers={"Accept": "image/*"})
        response = conn.getresponse()
        if response.status in _REDIRECTS:
            return response.status, response.getheader("Location"), b""
        return response.status, None, _read_body(response, conn, policy, error, deadline)
    except (OSError, http.client.HTTPException) as exc:
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
    """A connection to one checked address; the Host header (and the TLS name) stay the URL's host."""

    def pin(self, address: str, network: Network) -> None:
        self._address, self._network = address, network

    def _dial(self) -> socket.socket:
        return self._network.connect(self._address, self.port, self.timeout)


class _PinnedHTTP(_Pinned, http.client.HTTPConnection):
    def connect(self) -> None:
        self.sock = self._dial()


class _PinnedHTTPS(_Pinned, http.client.HTTPSConnection):
    def connect(self) -> None:
        self.sock = self._context.wrap_socket(self._dial(), server_hostname=self.host)
