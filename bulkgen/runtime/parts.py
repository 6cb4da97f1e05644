"""Result parts: the checkpoints of a batch, and their merge into the output and error files.

A part (`layout.part`: the batch's lines first..last) holds one entry per request on input lines first..last.
Whoever finishes a range writes its part (a retried range rewrites the same key), and everything
downstream de-duplicates by line: coverage for a resumed runner, counts, and the final merge, which
streams the parts in input order. At-least-once execution thus yields exactly one line per custom_id.

A request's output (or error) line is encoded once, where its part is written; the part keeps those
bytes as its entry's last field, and the merge copies them into the output file without decoding them.

Parts are read READERS at a time (`read_parts`: a window of whole parts, consumed in input order), so a
finalize or a resume of a million lines waits for about 1/READERS of the sum of S3's per-request
latencies, not all of it (31,250 parts of 32 lines: minutes, one GET at a time), in memory bounded by
the window.
"""

from __future__ import annotations

import json
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.outputlines import json_line
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.store import Store, layout

SPOOL_BYTES = 64 * 1024 * 1024
READERS = 16  # parts read at once (each a whole small object); the window ahead is twice this


_ENVELOPE = b',"envelope":'  # what precedes an entry's output line in its part line


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
        """{"line":..,"ok":..,"usage":[..],"envelope":{..}}: a JSON line whose last field is the output line's
        bytes as they are, so `decode` finds them without parsing them (the fields before hold no string)."""
        fields = {"line": self.line, "ok": self.ok, "usage": list(self.usage)}
        head = json.dumps(fields, separators=(",", ":"))
        return head[:-1].encode() + _ENVELOPE + self.envelope.rstrip(b"\n") + b"}\n"

    @classmethod
    def decode(cls, raw: bytes) -> PartEntry:
        cut = raw.index(_ENVELOPE)
        head = json.loads(raw[:cut] + b"}")
        envelope = raw[cut + len(_ENVELOPE) :].rstrip(b"\r\n")[:-1] + b"\n"
        return cls(head["line"], head["ok"], envelope, tuple(head["usage"]))


def write_part(
    store: Store, batch_id: str, first_line: int, last_line: int, entries: list[PartEntry]
) -> None:
    data = b"".join(e.encode() for e in sorted(entries, key=lambda e: e.line))
    store.write_bytes(layout.part(batch_id, first_line, last_line), data)


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
    found = []
    for key in store.list(layout.part_lines(batch_id)):
        lines = layout.part_range(key)
        if lines:
            found.append((key, *lines))
    return sorted(found, key=lambda p: (p[1], -p[2]))


def read_part(store: Store, key: str) -> Iterator[PartEntry]:
    for raw in store.iter_lines(key):
        if raw.strip():
            yield PartEntry.decode(raw)


def read_parts(store: Store, keys: Iterable[str], readers: int = READERS) -> Iterator[list[PartEntry]]:
    """Each part's entries, in the order of `keys`, read `readers` at a time (1: one after the other)."""
    if readers <= 1:
        yield from (list(read_part(store, key)) for key in keys)
        return
    with ThreadPoolExecutor(readers, thread_name_prefix="bulkgen-parts") as pool:
        window: deque = deque()
        for key in keys:
            window.append(pool.submit(lambda k=key: list(read_part(store, k))))
            if len(window) >= 2 * readers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


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


def merge_parts(store: Store, batch_id: str, readers: int = READERS):
    """-> (output file, error file, tally): spooled temp files in input-line order, one line per
    request; parts are read a window at a time (`read_parts`), so memory holds the window, not the batch."""
    outputs = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    errors = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    tally = Tally()
    last = covered = 0
    keys = []
    for key, _, last_line in iter_parts(store, batch_id):
        if last_line > covered:  # else wholly covered by an earlier part (a retried range)
            keys.append(key)
            covered = last_line
    for entries in read_parts(store, keys, readers):
        for e in entries:
            if e.line <= last:
                continue
            last = e.line
            (outputs if e.ok else errors).write(e.envelope)
            tally.add(e)
    outputs.seek(0)
    errors.seek(0)
    return outputs, errors, tally
