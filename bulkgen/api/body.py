"""Request bodies read under a byte limit and an idle timeout, counted as they arrive.

Every byte of a body counts (for an upload: fields, part headers and boundaries too). A body refused
before its end (too large, or stalled) is answered at once and its connection closed: nothing more of
it is read, so a client announcing 10 GB, or sending without end, costs nothing past the limit. A body
whose next bytes do not come within the app's `body_timeout_s` is a 408, so a client that stops
sending never holds a connection, a thread or a half-stored file for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from python_multipart.multipart import parse_options_header

from bulkgen.batch.schema import InvalidRequest
from bulkgen.settings import BODY_TIMEOUT_S


class TooLarge(InvalidRequest):
    status = 413

    def __init__(
        self, what: str, size: int | None, limit: int, param: str | None, code: str, form: int = 0
    ) -> None:
        """`form`: bytes allowed beyond `limit` for an upload's fields and multipart framing."""
        limit_text = f"{limit} bytes" + (f" (plus {form} bytes of form fields and framing)" if form else "")
        told = (
            f"{what} is {size} bytes; the limit is {limit_text}"
            if size is not None
            else (f"{what} passed the limit of {limit_text} while uploading; nothing was stored")
        )
        super().__init__(told, param=param, code=code)


class BodyTimeout(InvalidRequest):
    status = 408

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request body stalled: no bytes arrived for {timeout_s:g} s; nothing was "
            "stored. Send the whole body without pausing",
            code="request_timeout",
        )


class NotJson(InvalidRequest):
    status = 415


def declared_length(request: Request) -> int | None:
    value = request.headers.get("content-length", "")
    return int(value) if value.isdigit() else None


async def body_chunks(
    request: Request,
    limit: int,
    what: str = "the request body",
    param: str | None = None,
    code: str = "request_too_large",
    form: int = 0,
) -> AsyncIterator[bytes]:
    """The body's chunks; TooLarge once the declared length or the count passes `limit` + `form` bytes,
    BodyTimeout once no chunk came for the app's body timeout. (The answer to a refusal closes the
    connection: bulkgen.api.guard.)"""
    length = declared_length(request)
    if length is not None and length > limit + form:
        raise TooLarge(what, length, limit, param, code, form)
    timeout = getattr(request.app.state, "body_timeout_s", BODY_TIMEOUT_S)
    stream, size = request.stream(), 0
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), timeout)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise BodyTimeout(timeout) from None
        size += len(chunk)
        if size > limit + form:
            raise TooLarge(what, None, limit, param, code, form)
        yield chunk


async def read_json_body(request: Request, limit: int) -> bytes:
    """The body of a JSON request: sent as application/json (a cross-site form or `text/plain` post is
    refused, since browsers send those without asking), and refused (413) once it passes `limit` bytes."""
    content_type, _ = parse_options_header(request.headers.get("content-type"))
    if content_type != b"application/json":
        got = content_type.decode("latin-1")[:64] or "none"
        raise NotJson(
            f"send the body as JSON with Content-Type: application/json; got {got!r}",
            code="unsupported_media_type",
        )
    return b"".join([chunk async for chunk in body_chunks(request, limit)])
