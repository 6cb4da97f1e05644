"""Where each request of an input file lies and how much work it is, from one streamed pass.

The runner never holds the input file: it holds this index (28 bytes a request) and cuts line
ranges from it; a worker then fetches exactly its range's bytes with a ranged read. The work estimate
(prompt bytes / 4 + max_tokens × n) orders ranges longest first; the prefix key groups requests that
share a leading prompt (the system message) on one model or adapter, so one worker's prefix cache serves
them all.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from bulkgen.batch.budget import output_budget, prompt_estimate
from bulkgen.batch.messages import content_text
from bulkgen.batch.requests import LineError, ParsedRequest, parse_line
from bulkgen.batch.validate import lines_with_offsets

PREFIX_CHARS = 256


@dataclass
class LineIndex:
    lines: np.ndarray  # uint32: 1-based line number of each request (blank lines are no requests)
    starts: np.ndarray  # int64: byte offset where the line starts
    lengths: np.ndarray  # uint32: its bytes (newline excluded)
    work: np.ndarray  # uint32: estimated tokens of work
    prefix: np.ndarray  # uint64: key of the leading prompt part, 0 if none

    def __len__(self) -> int:
        return len(self.lines)

    @property
    def ends(self) -> _Ends:
        """ends[i]: the byte offset where request i's line ends (start + length; kept as two columns)."""
        return _Ends(self.starts, self.lengths)

    def positions(self, first_line: int, last_line: int) -> tuple[int, int]:
        """Index positions [lo, hi) of the requests on lines first_line..last_line."""
        lo = int(np.searchsorted(self.lines, first_line, side="left"))
        hi = int(np.searchsorted(self.lines, last_line, side="right"))
        return lo, hi


@dataclass(frozen=True)
class _Ends:
    starts: np.ndarray
    lengths: np.ndarray

    def __getitem__(self, i: int) -> int:
        return int(self.starts[i]) + int(self.lengths[i])


# the columns' machine types: 28 bytes a request (five 8-byte columns took 40)
_TYPES = (("I", np.uint32), ("q", np.int64), ("I", np.uint32), ("I", np.uint32), ("Q", np.uint64))
MAX_WORK = 2**32 - 1  # the work column's largest value (a request's estimate is clipped to it)


class IndexBuilder:
    """Collects the index one valid request at a time: `add` is validation's `on_request` callback, so a
    batch in `validating` is checked and indexed in one streamed pass."""

    def __init__(self) -> None:
        # machine-word arrays, not lists: 28 bytes a request while validating (lists of ints took ~190)
        self._cols: tuple[array, ...] = tuple(array(code) for code, _ in _TYPES)

    def __len__(self) -> int:
        return len(self._cols[0])

    def add(self, number: int, start: int, raw: bytes, request: ParsedRequest) -> None:
        values = (number, start, len(raw), _work(request), _prefix_key(request))
        for col, value in zip(self._cols, values, strict=True):
            col.append(value)

    def build(self) -> LineIndex:
        # views of the arrays' buffers, no copy: the builder cannot grow once built (BufferError)
        return LineIndex(
            *(np.frombuffer(col, kind) for col, (_, kind) in zip(self._cols, _TYPES, strict=True))
        )


def index_file(reader: BinaryIO, endpoint: str) -> LineIndex:
    """Index an already validated input file (a resumed batch) in bounded memory."""
    builder = IndexBuilder()
    for number, start, raw in lines_with_offsets(reader):
        if raw.strip():
            try:
                request = parse_line(raw, number, endpoint)
            except LineError:  # validated under looser rules than these: its worker refuses it alone
                request = ParsedRequest("", number, "", endpoint, prompt=raw.decode("utf-8", "replace"))
            builder.add(number, start, raw, request)
    return builder.build()


def _work(request) -> int:
    """Clipped to what the column holds (MAX_WORK: far more than any context), so a max_tokens of 2**63
    still fits."""
    max_tokens, sequences = output_budget(request)
    return min(prompt_estimate(request) + max_tokens * sequences, MAX_WORK)


def _prefix_key(request) -> int:
    """The system message (or a lone message's start; a text prompt's start): what a prefix cache shares.
    The model the line names is part of it: KV is never shared across LoRA adapters, and the dispatcher's
    affinity for a key then also keeps one adapter's lines on the worker that already holds it."""
    if request.messages is not None:
        first = request.messages[0]
        content = content_text(first["content"])
        text = content if first["role"] == "system" else content[:PREFIX_CHARS]
    else:
        text = request.prompt[:PREFIX_CHARS] if isinstance(request.prompt, str) else ""
    if not text:
        return 0
    keyed = f"{request.model}\0{text}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(keyed, digest_size=8).digest(), "little") or 1


def read_lines(store, input_key: str, first_line: int, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of the non-blank lines in bytes [start, end) of a stored input file,
    the first of which is `first_line`: a worker's range, fetched with one ranged read."""
    data = store.read_range(input_key, start, end)
    for number, piece in enumerate(data.split(b"\n"), start=first_line):
        raw = piece.removesuffix(b"\r")
        if raw.strip():
            yield number, raw
