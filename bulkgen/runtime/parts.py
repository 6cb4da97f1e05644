"""Result parts: the checkpoints of a batch, and their merge into the output and error files.

`parts/<batch>/part-<chunk>.jsonl` holds one line per request of that chunk; a retried chunk rewrites
the same key, so at-least-once execution still yields exactly one result per custom_id.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field

from bulkgen.store import Store

REFUSED_CHUNK = "refused"
_PART = re.compile(r"part-(\d+|refused)\.jsonl$")


def part_key(batch_id: str, chunk: int | str) -> str:
    name = chunk if isinstance(chunk, str) else f"{chunk:06d}"
    return f"parts/{batch_id}/part-{name}.jsonl"


@dataclass
class Tally:
    """request_counts and usage, as parts are written."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def add(self, entry: dict) -> None:
        if entry["ok"]:
            self.completed += 1
        else:
            self.failed += 1
        prompt, completion, cached = entry.get("usage", (0, 0, 0))
        self.input_tokens += prompt
        self.output_tokens += completion
        self.cached_tokens += cached

    def apply(self, record: dict) -> None:
        record["request_counts"].update(completed=self.completed, failed=self.failed)
        record["usage"].update(
            input_tokens=self.input_tokens, output_tokens=self.output_tokens,
            total_tokens=self.input_tokens + self.output_tokens,
        )
        record["usage"]["input_tokens_details"]["cached_tokens"] = self.cached_tokens


@dataclass
class PartIndex:
    done: set = field(default_factory=set)   # chunk numbers (and REFUSED_CHUNK) already written
    tally: Tally = field(default_factory=Tally)


def entry(line: int, ok: bool, envelope: dict, usage: tuple[int, int, int] = (0, 0, 0)) -> dict:
    return {"line": line, "ok": ok, "envelope": envelope, "usage": list(usage)}


def write_part(store: Store, batch_id: str, chunk: int | str, entries: list[dict]) -> None:
    data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode()
    store.write_bytes(part_key(batch_id, chunk), data)


def iter_part_keys(store: Store, batch_id: str):
    for key in store.list(f"parts/{batch_id}/"):
        match = _PART.search(key)
        if match:
            chunk = match.group(1)
            yield key, chunk if chunk == REFUSED_CHUNK else int(chunk)


def read_index(store: Store, batch_id: str) -> PartIndex:
    """What a resumed runner may skip, and the counts so far."""
    index = PartIndex()
    for key, chunk in iter_part_keys(store, batch_id):
        index.done.add(chunk)
        for raw in store.iter_lines(key):
            if raw.strip():
                index.tally.add(json.loads(raw))
    return index


def merge_parts(store: Store, batch_id: str):
    """-> (output file, error file, tally): spooled temp files in input-line order, one line per custom_id,
    and the counts and usage of exactly those lines."""
    entries = []
    for key, _ in iter_part_keys(store, batch_id):
        entries.extend(json.loads(raw) for raw in store.iter_lines(key) if raw.strip())
    entries.sort(key=lambda e: e["line"])
    outputs = tempfile.SpooledTemporaryFile(max_size=64 * 1024 * 1024)
    errors = tempfile.SpooledTemporaryFile(max_size=64 * 1024 * 1024)
    seen: set[str] = set()
    tally = Tally()
    for e in entries:
        custom_id = e["envelope"]["custom_id"]
        if custom_id in seen:
            continue
        seen.add(custom_id)
        (outputs if e["ok"] else errors).write(json.dumps(e["envelope"], ensure_ascii=False).encode() + b"\n")
        tally.add(e)
    outputs.seek(0)
    errors.seek(0)
    return outputs, errors, tally
