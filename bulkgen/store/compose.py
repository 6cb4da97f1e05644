"""One object made of byte ranges of others (`Store.compose`): what each piece of a multipart upload is.

S3 builds an object from parts of 5 MiB to 5 GiB (the last may be smaller), at most 10,000 of them, and
a part may be copied server-side from a range of another object (UploadPartCopy) instead of uploaded.
`plan_pieces` groups a run of spans into such parts: a span of at least 5 MiB is copied where it stands,
smaller ones are read and concatenated into uploaded parts, and a short run before a long span borrows
the long span's first bytes to reach 5 MiB, so the rest of the long span is still copied. The local
store needs none of this: it concatenates (`Store.compose` in base.py).
"""

from __future__ import annotations

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


@dataclass
class Piece:
    """One part of the composed object: a copy of one span (`copy`) or an upload of several read here."""

    spans: list[Span]
    copy: bool

    @property
    def size(self) -> int:
        return sum(s.size for s in self.spans)


def plan_pieces(
    spans: Iterable[Span], upload_size: int, min_part: int = MIN_PART, max_part: int = MAX_PART
) -> list[Piece]:
    """The parts of a multipart upload that writes the spans' concatenation: every part but the last at
    least `min_part`, a copy at most `max_part`, an upload closed once it holds `upload_size` bytes."""
    pieces: list[Piece] = []
    pending: list[Span] = []
    held = 0
    for span in (s for s in spans if s.size > 0):
        top_up = max(0, min_part - held) if pending else 0
        if span.size - top_up >= min_part:
            if pending:
                if top_up:
                    pending.append(Span(span.key, span.start, span.start + top_up))
                pieces.append(Piece(pending, copy=False))
                pending, held = [], 0
            pieces.extend(_copies(Span(span.key, span.start + top_up, span.end), max_part))
            continue
        pending.append(span)
        held += span.size
        if held >= upload_size:
            pieces.append(Piece(pending, copy=False))
            pending, held = [], 0
    if pending:
        pieces.append(Piece(pending, copy=False))
    if len(pieces) > MAX_PARTS:
        raise ValueError(f"{len(pieces)} parts: S3 composes at most {MAX_PARTS}; raise the upload size")
    return pieces


def _copies(span: Span, max_part: int) -> Iterator[Piece]:
    """A long span in equal copies of at most `max_part` (each then well above the minimum)."""
    count = -(-span.size // max_part)
    step = -(-span.size // count)
    for start in range(span.start, span.end, step):
        yield Piece([Span(span.key, start, min(start + step, span.end))], copy=True)


class SpanReader(io.RawIOBase):
    """The spans' concatenation as a stream, read a chunk at a time (`store.read_range`)."""

    def __init__(self, store: Any, spans: Iterable[Span], chunk: int = MiB) -> None:
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
            self._at = self._span.start
        end = min(self._span.end, self._at + min(len(buffer), self._chunk))
        data = self._store.read_range(self._span.key, self._at, end)
        if len(data) != end - self._at:
            raise ValueError(f"{self._span.key}: {len(data)} bytes at {self._at}, expected {end - self._at}")
        buffer[: len(data)] = data
        self._at = end
        return len(data)
