"""Result parts: the checkpoints of a batch, and their merge into the output and error files.

A part (`layout.part`: the batch's lines first..last) holds one entry per request on input lines first..last.
Whoever finishes a range writes its part (a retried range rewrites the same key), and everything
downstream de-duplicates by line: coverage for a resumed runner, counts, and the final merge, which
streams the parts in input order. At-least-once execution thus yields exactly one line per custom_id.

A request's output (or error) line is encoded once, where its part is written, and the part keeps those
bytes as they will stand in the output file: a part is a head line (`PartHead`: each entry's line, ok,
usage and byte length) and then its error lines, then its output lines, each in input order. So any
suffix of a part's entries is two byte ranges of it, and finalize writes the output file with
`Store.compose` from those ranges: S3 copies a part of 5 MiB or more server-side without a download
(store/compose.py), and the one ranged read of its start that finds the head holds its (usually few)
error lines too; smaller parts are read whole (one GET) and their bytes go in as they are. Parts written
before this format are still read: outputs before errors ({"v":2}), or one JSON line per entry
(`PartEntry.encode`).

Parts are read READERS at a time (`_windowed`: whole parts, or the head of a part to copy, consumed in
input order), so a finalize or a resume of a million lines waits for about 1/READERS of the sum of S3's
per-request latencies, not all of it (31,250 parts of 32 lines: minutes, one GET at a time), in memory
bounded by the window.
"""

from __future__ import annotations

import bisect
import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

import numpy as np

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.outputlines import json_line
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.runtime.not_run import NotRun
from bulkgen.store import Store, layout
from bulkgen.store.compose import MIN_PART, Source, Span

T = TypeVar("T")
SPOOL_BYTES = 64 * 1024 * 1024
READERS = 16  # parts read at once (each a whole small object); the window ahead is twice this
COPY_AT = MIN_PART  # a part this long is composed from its ranges, not read (S3's smallest copied part)
HEAD_PROBE = 64 * 1024  # the first read of a long part's head (doubled until the head line ends)

_ENVELOPE = b',"envelope":'  # what precedes an entry's output line in its line (the format before PartHead)
_HEAD = b'{"v":'  # how a part with a head line begins (v2: outputs before errors; v3: errors first)
VERSION = 3


@dataclass
class PartEntry:
    """One request's result, as its part stores it (one JSON line, `encode`)."""

    line: int  # the request's line in the input file
    ok: bool  # its line goes to the output file (else to the error file)
    envelope: bytes  # that line as `responses.json_line` encoded it (newline included)
    usage: tuple[int, ...] = (0, 0, 0, 0)  # prompt, completion, cached and reasoning tokens (parts written
    # before reasoning was counted hold the first three)

    @classmethod
    def of(cls, line: int, ok: bool, envelope: dict, usage: tuple[int, ...] = (0, 0, 0, 0)) -> PartEntry:
        return cls(line, ok, json_line(envelope), tuple(usage))

    def encode(self) -> bytes:
        """{"line":..,"ok":..,"usage":[..],"envelope":{..}}: one entry as parts held it before PartHead (a
        JSON line whose last field is the output line's bytes as they are); `decode` still reads it."""
        fields = {"line": self.line, "ok": self.ok, "usage": list(self.usage)}
        head = json.dumps(fields, separators=(",", ":"))
        return head[:-1].encode() + _ENVELOPE + self.envelope.rstrip(b"\n") + b"}\n"

    @classmethod
    def decode(cls, raw: bytes) -> PartEntry:
        cut = raw.index(_ENVELOPE)
        head = json.loads(raw[:cut] + b"}")
        envelope = raw[cut + len(_ENVELOPE) :].rstrip(b"\r\n")[:-1] + b"\n"
        return cls(head["line"], head["ok"], envelope, tuple(head["usage"]))


@dataclass
class PartHead:
    """A part's first line, {"v":3,"entries":[[line, ok, bytes, *usage], ..]}, and its length (`start`):
    where each entry's line lies in the part (errors from `start` on, then outputs, both by line; v2 had
    the outputs first)."""

    entries: list[PartEntry]  # in input order, their envelopes not read (b"")
    lengths: list[int]  # each entry's line's bytes, newline included
    start: int
    errors_first: bool = True

    @classmethod
    def of(cls, data: bytes) -> PartHead:
        line = data[: data.index(b"\n")]
        head = json.loads(line)
        entries = [PartEntry(r[0], bool(r[1]), b"", tuple(r[3:])) for r in head["entries"]]
        return cls(entries, [r[2] for r in head["entries"]], len(line) + 1, head["v"] >= VERSION)

    def after(self, line: int) -> tuple[list[PartEntry], range, range]:
        """The entries past input line `line` and where their output and error lines lie in the part:
        (entries, the outputs' bytes, the errors' bytes)."""
        cut = bisect.bisect_right([e.line for e in self.entries], line)
        sums = {True: [0, 0], False: [0, 0]}  # per kind: bytes before the cut, bytes in all
        for i, (e, n) in enumerate(zip(self.entries, self.lengths, strict=True)):
            sums[e.ok][1] += n
            sums[e.ok][0] += n if i < cut else 0
        first = not self.errors_first  # the kind whose lines come first: False, the errors (v2: outputs)
        at = {first: self.start, not first: self.start + sums[first][1]}
        spans = {ok: range(at[ok] + sums[ok][0], at[ok] + sums[ok][1]) for ok in (True, False)}
        return self.entries[cut:], spans[True], spans[False]


def encode_part(entries: list[PartEntry]) -> bytes:
    entries = sorted(entries, key=lambda e: e.line)
    rows = [[e.line, int(e.ok), len(e.envelope), *e.usage] for e in entries]
    head = json.dumps({"v": VERSION, "entries": rows}, separators=(",", ":")).encode()
    errors = b"".join(e.envelope for e in entries if not e.ok)
    return head + b"\n" + errors + b"".join(e.envelope for e in entries if e.ok)


def decode_part(data: bytes) -> list[PartEntry]:
    if not data.startswith(_HEAD):
        return [PartEntry.decode(raw) for raw in data.split(b"\n") if raw.strip()]
    head = PartHead.of(data)
    _, outputs, errors = head.after(-1)
    at = {True: outputs.start, False: errors.start}
    for e, n in zip(head.entries, head.lengths, strict=True):
        e.envelope, at[e.ok] = data[at[e.ok] : at[e.ok] + n], at[e.ok] + n
    return head.entries


def write_part(
    store: Store, batch_id: str, first_line: int, last_line: int, entries: list[PartEntry]
) -> None:
    store.write_bytes(layout.part(batch_id, first_line, last_line), encode_part(entries))


def delete_parts(store: Store, batch_id: str) -> int:
    """Drop the intermediate results of an ended batch (its output is final): the line parts. The small
    runner notes stay, as the record of who ran it; the metrics state lives with the reports."""
    return store.delete_prefix(layout.part_lines(batch_id))


@dataclass
class Tally:
    """request_counts and usage of the entries counted so far."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, entry: PartEntry) -> None:
        if entry.ok:
            self.completed += 1
        else:
            self.failed += 1
        prompt, completion, cached, *reasoning = entry.usage
        self.input_tokens += prompt
        self.output_tokens += completion
        self.cached_tokens += cached
        self.reasoning_tokens += sum(reasoning)

    def merge(self, other: Tally) -> None:
        for name, value in other.__dict__.items():
            setattr(self, name, getattr(self, name) + value)

    def apply(self, record: BatchRecord) -> None:
        record.request_counts.completed, record.request_counts.failed = self.completed, self.failed
        record.usage.update(
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            total_tokens=self.input_tokens + self.output_tokens,
        )
        record.usage["input_tokens_details"]["cached_tokens"] = self.cached_tokens
        record.usage.setdefault("output_tokens_details", {})["reasoning_tokens"] = self.reasoning_tokens


def iter_parts(store: Store, batch_id: str) -> list[tuple[str, int, int]]:
    """(key, first line, last line), in input order (a wider part first where two start together)."""
    return [(key, first, last) for key, first, last, _ in _listed_parts(store, batch_id)]


def _listed_parts(store: Store, batch_id: str) -> list[tuple[str, int, int, int]]:
    """As iter_parts, with each part's size (from the same listing)."""
    found = []
    for info in store.list_objects(layout.part_lines(batch_id)):
        lines = layout.part_range(info.key)
        if lines:
            found.append((info.key, *lines, info.size))
    return sorted(found, key=lambda p: (p[1], -p[2]))


def read_part(store: Store, key: str) -> list[PartEntry]:
    return decode_part(store.read_bytes(key))


def _windowed(read: Callable[[str], T], keys: Iterable[str], readers: int) -> Iterator[T]:
    """read(key) of each key, in the order of `keys`, `readers` at a time (1: one after the other)."""
    if readers <= 1:
        yield from (read(key) for key in keys)
        return
    with ThreadPoolExecutor(readers, thread_name_prefix="bulkgen-parts") as pool:
        window: deque = deque()
        for key in keys:
            window.append(pool.submit(read, key))
            if len(window) >= 2 * readers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


def read_parts(store: Store, keys: Iterable[str], readers: int = READERS) -> Iterator[list[PartEntry]]:
    """Each part's entries, in the order of `keys`, read `readers` at a time (1: one after the other)."""
    return _windowed(lambda key: read_part(store, key), keys, readers)


def coverage(store: Store, batch_id: str, index: LineIndex) -> tuple[np.ndarray, Tally]:
    """Which requests already have a result (a mask over the index) and the counts of those results."""
    done = np.zeros(len(index), dtype=bool)
    tally = Tally()
    keys = [key for key, _, _ in iter_parts(store, batch_id)]
    for entries in read_parts(store, keys):
        for e in entries:
            pos = int(np.searchsorted(index.lines, e.line))
            if pos < len(index) and index.lines[pos] == e.line and not done[pos]:
                done[pos] = True
                tally.add(e)
    return done, tally


def merge_parts(
    store: Store,
    batch_id: str,
    errors: BinaryIO,
    tally: Tally,
    readers: int = READERS,
    not_run: NotRun | None = None,
) -> Iterator[Source]:
    """The output file's sources for `store.compose`, in input-line order, one line per request (a retried
    range's lines once); the error lines are written to `errors` and every entry counted in `tally` as the
    sources are consumed. A part under COPY_AT is read whole and gives its bytes; a longer one gives its
    head and then a range of itself (S3 copies it), so memory holds the window, not the batch. `not_run` (a
    stopped batch): the requests no part covers get its error lines, in input order among the parts' own."""
    last = covered = 0
    chosen = []
    for key, first_line, last_line, size in _listed_parts(store, batch_id):
        if last_line > covered:  # else wholly covered by an earlier part (a retried range)
            chosen.append((key, first_line, covered, size))  # covered: the last line before it
            covered = last_line
    sizes = {key: size for key, _, _, size in chosen}
    reads = _windowed(lambda k: _read_for_merge(store, k, sizes[k]), sizes, readers)
    for (key, data, head, whole), (_, first_line, before, _) in zip(reads, chosen, strict=True):
        if not_run is not None and first_line > before + 1:
            tally.failed += not_run.gap(before, first_line, errors)
        if head is None:  # a part in the format before PartHead
            entries = [e for e in decode_part(data) if e.line > last]
            outputs = b"".join(e.envelope for e in entries if e.ok)
            errors.write(b"".join(e.envelope for e in entries if not e.ok))
        else:
            entries, out, err = head.after(last)
            outputs = data[out.start : out.stop] if whole else Span(key, out.start, out.stop)
            errors.write(_bytes_of(store, key, data, err))
        for e in entries:
            tally.add(e)
        last = entries[-1].line if entries else last
        yield outputs
    if not_run is not None:
        tally.failed += not_run.gap(covered, None, errors)


def _read_for_merge(store: Store, key: str, size: int) -> tuple[str, bytes, PartHead | None, bool]:
    """(key, bytes read, the part's head or None, whether they are the whole part): a part under COPY_AT is
    read whole, a longer one from its start as far as its head line ends, at least HEAD_PROBE bytes (its
    error lines follow the head, so that read usually holds them too); a part in the old format whole."""
    if size < COPY_AT:
        data = store.read_bytes(key)
        return key, data, PartHead.of(data) if data.startswith(_HEAD) else None, True
    probe = HEAD_PROBE
    while True:
        data = store.read_range(key, 0, min(probe, size))
        if not data.startswith(_HEAD):
            return key, store.read_bytes(key), None, True
        if b"\n" in data or probe >= size:
            return key, data, PartHead.of(data), len(data) == size
        probe *= 2


def _bytes_of(store: Store, key: str, data: bytes, span: range) -> bytes:
    """Bytes `span` of the part at `key`, of which `data` holds the first len(data): a ranged read only for
    what `data` lacks."""
    held = data[span.start : span.stop]
    if span.start + len(held) >= span.stop:
        return held
    return held + store.read_range(key, span.start + len(held), span.stop)
