"""A batch's parts merged as finalize merges them (bulkgen.runtime.parts.merge_parts), read back as bytes."""

from __future__ import annotations

import io
import json

from bulkgen.runtime import parts
from bulkgen.store.compose import SpanReader


def merged(store, batch_id: str, readers: int = parts.READERS) -> tuple[bytes, bytes, parts.Tally]:
    """(output bytes, error bytes, tally): the output file's sources read here instead of composed."""
    errors, tally = io.BytesIO(), parts.Tally()
    sources = parts.merge_parts(store, batch_id, errors, tally, readers)
    return io.BufferedReader(SpanReader(store, sources)).read(), errors.getvalue(), tally


def stored_entries(store, batch_id: str) -> dict[int, dict]:
    """Every stored entry of the batch's parts by input line, as {"line", "ok", "usage", "envelope"} with
    the envelope decoded; a line stored twice fails."""
    found: dict[int, dict] = {}
    for key, _, _ in parts.iter_parts(store, batch_id):
        for e in parts.read_part(store, key):
            assert e.line not in found, f"line {e.line} stored twice"
            found[e.line] = {
                "line": e.line,
                "ok": e.ok,
                "usage": list(e.usage),
                "envelope": json.loads(e.envelope),
            }
    return found


def envelopes(stored: dict[str, bytes]) -> list[dict]:
    """The output and error lines (decoded) of parts read earlier as {key: bytes}."""
    return [json.loads(e.envelope) for data in stored.values() for e in parts.decode_part(data)]
