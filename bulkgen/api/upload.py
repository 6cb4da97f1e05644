"""File uploads: a multipart stream parsed as it arrives, its file part streamed into storage.

The multipart stream is parsed here (python-multipart's streaming parser) and its file part flows straight
into storage through a bounded pipe, so a 200 MB upload never sits whole in memory or on local disk. The
body is read through bulkgen.api.body (every byte counted, stalls timed out); once it is refused, or the
client goes away, or the body ends before the form's closing boundary (every declared byte came, but not
the whole form: 400 incomplete_upload), the upload is aborted: the store publishes nothing partial and the
thread ends.
Form fields other than KNOWN_FIELDS are refused by name.
"""

from __future__ import annotations

import asyncio
import io
import queue
import threading
from collections.abc import Callable
from typing import BinaryIO

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartState, parse_options_header

from bulkgen.api.body import TooLarge, body_chunks
from bulkgen.batch.schema import InvalidRequest, quote

FIELD_LIMIT = 64 * 1024  # a form field other than the file (purpose, expires_after[...])
FORM_OVERHEAD = 64 * 1024  # multipart boundaries, part headers and fields allowed beyond the file itself
KNOWN_FIELDS = ("file", "purpose", "expires_after[anchor]", "expires_after[seconds]")
_EOF, _ABORT = object(), object()


class _Pipe(io.RawIOBase):
    """Chunks handed over from the event loop to the thread that uploads them (bounded: back-pressure)."""

    def __init__(self) -> None:
        self.chunks: queue.Queue = queue.Queue(maxsize=64)
        self.aborted = False
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not len(self._buf):
            item = self.chunks.get()
            if self.aborted or item is _ABORT:
                raise UploadAborted("the upload was refused")
            if item is _EOF:
                self.chunks.put(_EOF)
                return 0
            self._buf = memoryview(item)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    async def put(self, item) -> None:
        """Wait (without holding a thread: no pool can run dry) while the uploading thread catches up."""
        while True:
            try:
                return self.chunks.put_nowait(item)
            except queue.Full:
                await asyncio.sleep(0.005)

    def abort(self) -> None:
        """Never blocks: a reader waiting on an empty queue gets _ABORT, one with items sees the flag."""
        self.aborted = True
        try:
            self.chunks.put_nowait(_ABORT)
        except queue.Full:
            pass


class UploadAborted(Exception):
    pass


class _Form:
    """Events of python-multipart's parser, kept until the event loop handles them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bytes]] = []
        self._field, self._value = b"", b""

    def callbacks(self) -> dict[str, Callable]:
        return {
            "on_part_begin": lambda: self.events.append(("begin", b"")),
            "on_header_field": lambda d, s, e: setattr(self, "_field", self._field + d[s:e]),
            "on_header_value": lambda d, s, e: setattr(self, "_value", self._value + d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": lambda: self.events.append(("headers_done", b"")),
            "on_part_data": lambda d, s, e: self.events.append(("data", bytes(d[s:e]))),
            "on_part_end": lambda: self.events.append(("end", b"")),
        }

    def _header_end(self) -> None:
        if self._field.lower() == b"content-disposition":
            self.events.append(("disposition", self._value))
        self._field, self._value = b"", b""


async def receive_upload(
    request: Request, limit: int, store: Callable[[BinaryIO], tuple[str, int]], discard: Callable[[str], None]
) -> tuple[dict[str, str], str, str, int]:
    """Parse a multipart upload; its `file` part streams into `store(reader) -> (file id, size)` (run in a
    thread), and `discard(file id)` removes it if the request fails after it was stored.
    -> (other form fields, filename, file id, size). Refused past `limit` file bytes, or past `limit` plus
    FORM_OVERHEAD bytes of body in all, and once the body stalls (see bulkgen.api.body)."""
    content_type, options = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data" or not options.get(b"boundary"):
        raise InvalidRequest("upload with Content-Type multipart/form-data (fields: file, purpose)")
    form = _Form()
    parser = MultipartParser(options[b"boundary"], form.callbacks())
    upload = _Upload(store)
    try:
        async for chunk in body_chunks(request, limit, "the upload", "file", "file_too_large", FORM_OVERHEAD):
            parser.write(chunk)
            await upload.handle(form.events, limit)
            form.events.clear()
        parser.finalize()
        await upload.handle(form.events, limit)
        if parser.state != MultipartState.END:  # the parser's finalize does not check this itself
            raise InvalidRequest(
                "the multipart body ended before its closing boundary (--BOUNDARY--): the upload is "
                "incomplete and nothing was stored. Send the whole form",
                param="file",
                code="incomplete_upload",
            )
        if upload.task is None:
            raise InvalidRequest("the upload has no `file` part", param="file")
        _refuse_unknown(upload.fields)
        file_id, size = await upload.task
    except FormParserError as exc:
        await upload.abort(discard)
        raise InvalidRequest(f"the multipart body is malformed: {exc}", param="file") from None
    except (
        BaseException
    ):  # refused, the client went away, or the store failed: publish nothing, leave no thread
        await upload.abort(discard)
        raise
    return upload.fields, upload.filename, file_id, size


def _refuse_unknown(fields: dict[str, str]) -> None:
    """A field bulkgen would not honour (e.g. `expires_after` as one JSON field) is refused by name."""
    for name in fields:
        if name not in KNOWN_FIELDS:
            raise InvalidRequest(
                f"unknown form field {quote(name, 64)}: bulkgen refuses what it cannot honour; "
                f"the fields are {', '.join(KNOWN_FIELDS)}",
                param=name[:64],
                code="unknown_parameter",
            )


class _Upload:
    def __init__(self, store: Callable[[BinaryIO], tuple[str, int]]) -> None:
        self.store = store
        self.fields: dict[str, str] = {}
        self.filename = "upload.jsonl"
        self.task = None
        self.pipe: _Pipe | None = None
        self.size = 0
        self._name: str | None = None
        self._value = bytearray()
        self._in_file = False

    async def handle(self, events: list[tuple[str, bytes]], limit: int) -> None:
        for kind, data in events:
            if kind == "begin":
                self._name, self._value, self._in_file = None, bytearray(), False
            elif kind == "disposition":
                _, params = parse_options_header(data)
                self._name = params.get(b"name", b"").decode("utf-8", "replace")
                if b"filename" in params:
                    self.filename = params[b"filename"].decode("utf-8", "replace")[:255] or self.filename
            elif kind == "headers_done" and self._name == "file":
                if self.task is not None:
                    raise InvalidRequest("the upload has more than one `file` part", param="file")
                self._start()
                self._in_file = True
            elif kind == "data" and self._in_file:
                self.size += len(data)
                if self.size > limit:
                    raise TooLarge("the file", None, limit, "file", "file_too_large")
                await self.pipe.put(data)
            elif kind == "data":
                self._value += data
                if len(self._value) > FIELD_LIMIT:
                    raise InvalidRequest(
                        f"form field {quote(self._name)} is over {FIELD_LIMIT} bytes",
                        param=(self._name or "")[:64],
                    )
            elif kind == "end" and self._in_file:
                await self.pipe.put(_EOF)
                self._in_file = False
            elif kind == "end" and self._name:
                self.fields[self._name] = self._value.decode("utf-8", "replace")

    def _start(self) -> None:
        """The store reads the pipe in a thread of its own for the whole upload (not a pool's)."""
        loop = asyncio.get_running_loop()
        self.pipe = _Pipe()
        reader = io.BufferedReader(self.pipe, buffer_size=1 << 20)
        self.task = done = loop.create_future()

        def settle(result=None, error: BaseException | None = None) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def run() -> None:
            try:
                result = self.store(reader)
            except BaseException as exc:  # handed to the request, which aborts and answers
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, result)

        threading.Thread(target=run, name="bulkgen-upload", daemon=True).start()

    async def abort(self, discard: Callable[[str], None]) -> None:
        """Stop the upload thread; what it stored already (a complete file part) is discarded."""
        if self.task is None:
            return
        self.pipe.abort()
        try:
            file_id, _ = await self.task
        except Exception:  # aborted (or the store failed on its own): the store published nothing
            return
        await run_in_threadpool(discard, file_id)
