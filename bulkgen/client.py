"""Client-side helpers behind `bulkgen submit/status/results`: the official openai package, unchanged."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bulkgen.batch.schema import TERMINAL_STATUSES


class ClientError(Exception):
    """A problem to show the user in one line (no traceback)."""


def detect_endpoint(path: Path) -> str:
    """The `url` of the first request line, so users need not repeat it on the command line."""
    with open(path, "rb") as f:
        return endpoint_of(f, str(path))


def endpoint_of(lines: Iterable[bytes], where: str) -> str:
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                raise ClientError(f"{where}:{number}: not a JSON object; is this a JSONL batch file?") from None
            if not isinstance(url, str):
                raise ClientError(f"{where}:{number}: no 'url' field; pass --endpoint")
            return url
    raise ClientError(f"{where} has no request lines")


def make_client(base_url: str | None, api_key: str | None):
    from openai import OpenAI

    return OpenAI(base_url=base_url or "http://127.0.0.1:8000/v1", api_key=api_key or "bulkgen", max_retries=3)


def format_errors(batch) -> str:
    errors = getattr(batch, "errors", None)
    data = errors.data if errors and errors.data else []
    return "\n".join(f"  line {e.line}: [{e.code}] {e.message}" if e.line else f"  [{e.code}] {e.message}"
                     for e in data)


def wait(get_batch: Callable[[], object], on_update: Callable[[object], None], interval: float = 1.0):
    """Poll until the batch reaches a terminal status."""
    while True:
        batch = get_batch()
        on_update(batch)
        if batch.status in TERMINAL_STATUSES:
            return batch
        time.sleep(interval)


def validated(get_batch: Callable[[], object], interval: float = 0.5):
    """Poll a just-created batch until validation has ended (it answers `validating` at once)."""
    while (batch := get_batch()).status == "validating":
        time.sleep(interval)
    return batch


def output_paths(output: Path) -> tuple[Path, Path]:
    """`results.jsonl` -> (results.jsonl, results.errors.jsonl)."""
    stem = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output, output.with_name(f"{stem}.errors.jsonl")


def download(client, batch, output: Path) -> list[str]:
    """Write the output and error files; returns one line per file written."""
    out_path, err_path = output_paths(output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for file_id, path in ((batch.output_file_id, out_path), (batch.error_file_id, err_path)):
        if file_id:
            path.write_bytes(client.files.content(file_id).content)
            lines = sum(1 for _ in path.open("rb"))
            written.append(f"{path} ({lines} lines)")
    return written
