"""One object made of byte ranges of others (`Store.compose`): what each piece of a multipart upload is.

S3 builds an object from parts of 5 MiB to 5 GiB (the last may be smaller), at most 10,000 of them, and
a part may be copied server-side from a range of another object (UploadPartCopy) instead of uploaded.
`plan_pieces` groups a run of spans into such parts: a span of at least 5 MiB is copied where it stands,
smaller ones are read and concatenated into uploaded parts, and a short run before a long span borrows
the long span's first bytes to reach 5 MiB, so the rest of the long span is still copied. A source may
also be bytes already read (finalize reads small parts whole): they go into uploaded parts. The local
store needs none of this: it concatenates (`Store.compose` in base.py). Pieces are planned as the
sources come, so a composer holds one upload's bytes at a time, not the object.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's smallest part but the last
MAX_PART = 5 * 1024 * MiB  # S3's largest part
MAX_PARTS = 10_000


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of the object at `key`."""

    key: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


Source = Span | bytes  # a range of a stored object, or bytes already read


def source_size(source: Source) -> int:
    return source.size if isinstance(source, Span) else len(source)


@dataclass
class Piece:
    """One part of the composed object: a copy of one span (`copy`) or an upload of sources read here."""

    spans: list[Source]
    copy: bool

    @property
    def size(self) -> int:
        return sum(source_size(s) for s in self.spans)


def plan_pieces(
    sources: Iterable[Source], upload_size: int, min_part: int = MIN_PART, max_part: int = MAX_PART
) -> Iterator[Piece]:
    """The parts of a multipart upload that writes the sources' concatenation, in order: every part but
    the last at least `min_part`, a copy at most `max_part`, an upload closed once it holds `upload_size`."""
    pending: list[Source] = []
    held = count = 0
    for source in sources:
        size = source_size(source)
        top_up = max(0, min_part - held) if pending else 0
        if isinstance(source, Span) and size - top_up >= min_part:
            if pending:
                if top_up:
                    pending.append(Span(source.key, source.start, source.start + top_up))
                yield Piece(pending, copy=False)
                count, pending, held = count + 1, [], 0
            for piece in _copies(Span(source.key, source.start + top_up, source.end), max_part):
                count += 1
                _check_count(count)
                yield piece
        elif size:
            pending.append(source)
            held += size
            if held >= upload_size:
                count += 1
                _check_count(count)
                yield Piece(pending, copy=False)
                pending, held = [], 0
    if pending:
        _check_count(count + 1)
        yield Piece(pending, copy=False)


def _check_count(count: int) -> None:
    if count > MAX_PARTS:
        raise ValueError(
            f"more than {MAX_PARTS} parts: S3 composes at most {MAX_PARTS}; raise the upload size"
        )


def _copies(span: Span, max_part: int) -> Iterator[Piece]:
    """A long span in equal copies of at most `max_part` (each then well above the minimum)."""
    count = -(-span.size // max_part)
    step = -(-span.size // count)
    for start in range(span.start, span.end, step):
        yield Piece([Span(span.key, start, min(start + step, span.end))], copy=True)


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives the object a multipart upload of these parts completes: the MD5 of their MD5s,
    then '-' and their count (how a retried completion recognizes the object its lost answer made)."""
    digests = b"".join(bytes.fromhex(etag.strip('"')) for etag in part_etags)
    return f'"{hashlib.md5(digests).hexdigest()}-{len(part_etags)}"'


class SpanReader(io.RawIOBase):
    """The sources' concatenation as a stream, spans read a chunk at a time (`store.read_range`)."""

    def __init__(self, store: Any, spans: Iterable[Source], chunk: int = MiB) -> None:
        self._store, self._spans, self._chunk = store, iter(spans), chunk
        self._span: Span | None = None
        self._at = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._span is None or self._at >= self._span.end:
            self._span = next(self._spans, None)
            if self._span is None:
                return 0
            if not isinstance(self._span, Span):
                self._span = _Held(self._span)
            self._at = self._span.start
        end = min(self._span.end, self._at + min(len(buffer), self._chunk))
        if isinstance(self._span, _Held):
            data = self._span.data[self._at : end]
        else:
            data = self._store.read_range(self._span.key, self._at, end)
        if len(data) != end - self._at:
            raise ValueError(f"{self._span.key}: {len(data)} bytes at {self._at}, expected {end - self._at}")
        buffer[: len(data)] = data
        self._at = end
        return len(data)


class _Held:
    """Bytes already read, as a span of themselves (`SpanReader` reads them with `read_range`)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.start, self.end, self.key = data, 0, len(data), None
