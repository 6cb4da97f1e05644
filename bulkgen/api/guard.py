"""What a browser may not make this service do: the checks in front of every route, and security headers.

A keyless service (the default) trusts whoever can reach it, and a web page the user visits can reach
127.0.0.1 too. So, before any route runs:
- `Host` must name this service: the address it answers on (127.0.0.1, localhost, [::1] or the socket's
  own address, with its port) or one of `allowed_hosts` ('NAME', 'NAME:PORT', '.DOMAIN' or '*'). A DNS-rebinding page's Host is its own name.
- A state-changing request (POST, PUT, PATCH, DELETE) that carries an `Origin` must come from this
  service's own origin: browsers send Origin on cross-site writes, and an HTML form needs no CORS check.
Every response carries a Content-Security-Policy without inline script, refuses framing and MIME
sniffing, and sends no Referer. A response sent before the request's body was read to its end (a refusal)
closes the connection: otherwise the server would go on reading that body, to whatever end it claims. (JSON routes also refuse a non-JSON Content-Type: bulkgen.api.body.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bulkgen.api.errors import error_body
from bulkgen.batch.schema import quote

log = logging.getLogger(__name__)
LOCAL_NAMES = ("127.0.0.1", "localhost", "[::1]")
WRITES = ("POST", "PUT", "PATCH", "DELETE")
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
_DEFAULT_PORTS = {"http": "80", "https": "443"}


class Guard:
    """ASGI middleware: Host and Origin checks, then the app; security headers on whatever answers."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] = ()) -> None:
        self.app = app
        self.allowed = {h.strip().lower() for h in allowed_hosts if h.strip()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        body_done = headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers

        async def receive_body() -> Message:
            nonlocal body_done
            message = await receive()
            body_done = body_done or (message["type"] == "http.request" and not message.get("more_body"))
            return message

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
                if not body_done:  # answered before the body's end (refused): the server would read it all
                    message["headers"].append((b"connection", b"close"))
            await send(message)

        started, refusal = False, self.refusal(scope, headers)
        if refusal is not None:
            status, message, code = refusal
            response = JSONResponse(error_body(message, code=code), status_code=status)
            return await response(scope, receive_body, send_with_headers)
        try:
            await self.app(scope, receive_body, send_with_headers)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs once its shutdown grace period is over: one line, no traceback
            log.warning("%s %s stopped: the service is shutting down", scope["method"], scope["path"])
            if not started:
                body = error_body(
                    "the service is shutting down; try again", code="shutting_down", error_type="server_error"
                )
                await JSONResponse(body, status_code=503)(scope, receive_body, send_with_headers)

    def refusal(self, scope: Scope, headers: Headers) -> tuple[int, str, str] | None:
        host = headers.get("host", "").strip().lower()
        if not self.host_allowed(host, scope.get("server")):
            return (
                400,
                (
                    f"Host {quote(host, 64)} is not this service's: it answers as 127.0.0.1, localhost or [::1] "
                    "with its port; name other hosts with --allowed-hosts"
                ),
                "invalid_host",
            )
        origin = headers.get("origin")
        if scope["method"] in WRITES and origin is not None and _netloc(origin) != host:
            return (
                403,
                (
                    f"cross-site request refused: Origin {quote(origin, 64)} is not this service's own "
                    f"({quote(host, 64)})"
                ),
                "cross_origin_refused",
            )
        return None

    def host_allowed(self, host: str, server: tuple[str, int | None] | None) -> bool:
        if "*" in self.allowed or host in self.allowed:
            return True
        name, port = _split(host)
        if name in self.allowed or any(e[0] == "." and f".{name}".endswith(e) for e in self.allowed):
            return True  # 'NAME' on any port; '.DOMAIN': the domain and every name under it
        if server is None:  # not a socket (an in-process test client): nothing to compare with
            return True
        own = {*LOCAL_NAMES, f"[{server[0]}]" if ":" in server[0] else server[0]}
        return bool(name) and name in own and port == str(server[1] or 80)


def _split(host: str) -> tuple[str, str]:
    """'name:port' (a bracketed IPv6 address keeps its brackets) -> (name, port); the port defaults to 80."""
    name, colon, port = host.rpartition(":")
    if not colon or "]" in port:
        return host, "80"
    return name, port


def _netloc(origin: str) -> str:
    """An Origin as a Host header would spell it (the scheme's default port left out); '' for 'null'."""
    try:
        parts = urlsplit(origin.strip().lower())
    except ValueError:  # e.g. 'http://[' (not an origin any browser sends): matches no Host
        return ""
    netloc = parts.netloc
    default = _DEFAULT_PORTS.get(parts.scheme)
    if default and netloc.endswith(f":{default}"):
        netloc = netloc[: -len(default) - 1]
    return netloc
