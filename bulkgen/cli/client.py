"""Client-side helpers behind `bulkgen submit/status/results`: the official openai package, unchanged."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bulkgen.batch.requests import LineError, url_of
from bulkgen.batch.resultfiles import local_results
from bulkgen.batch.schema import TERMINAL_STATUSES, BatchStatus


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
                url = url_of(raw)
            except LineError:
                raise ClientError(
                    f"{where}:{number}: not a JSON object; is this a JSONL batch file?"
                ) from None
            if url is None:
                raise ClientError(f"{where}:{number}: no 'url' field; pass --endpoint")
            return url
    raise ClientError(f"{where} has no request lines")


def make_client(base_url: str | None, api_key: str | None):
    from openai import OpenAI

    return OpenAI(
        base_url=base_url or "http://127.0.0.1:8000/v1", api_key=api_key or "bulkgen", max_retries=3
    )


def format_errors(batch) -> str:
    errors = getattr(batch, "errors", None)
    data = errors.data if errors and errors.data else []
    return "\n".join(
        f"  line {e.line}: [{e.code}] {e.message}" if e.line else f"  [{e.code}] {e.message}" for e in data
    )


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
    while (batch := get_batch()).status == BatchStatus.VALIDATING:
        time.sleep(interval)
    return batch


def download(client, batch, output: Path) -> list[str]:
    """Write the output and error files; returns one line per file written."""
    folder, names = local_results(output)
    written = []
    for file_id, name in (
        (batch.output_file_id, names.output),
        (batch.error_file_id, names.of("errors.jsonl")),
    ):
        if file_id:
            data = client.files.content(file_id).content
            folder.write_bytes(name, data)
            written.append(f"{folder.folder / name} ({len(data.splitlines())} lines)")
    return written


def retry_chain(get_batch: Callable[[str], object], batch_id: str) -> list:
    """The batches of `batch_id`'s retry chain (bulkgen.batch.retry's links: fields the openai package
    keeps as extras), the original first."""
    batch, seen = get_batch(batch_id), {batch_id}
    while (parent := _link(batch, "retry_of")) and parent not in seen:
        seen.add(parent)
        batch = get_batch(parent)
    chain = [batch]
    while (child := _link(batch, "retried_by")) and child not in {b.id for b in chain}:
        batch = get_batch(child)
        chain.append(batch)
    return chain


def _link(batch, name: str) -> str | None:
    return (batch.model_extra or {}).get(name)


def download_merged(client, chain: list, output: Path) -> list[str]:
    """Write one output and one error file across the chain (bulkgen.batch.merged); files are streamed to a
    temporary folder first, so memory stays bounded whatever their size."""
    import contextlib
    import tempfile

    from bulkgen.batch.merged import merge_chain

    running = [b.id for b in chain if b.status not in TERMINAL_STATUSES]
    if running:
        raise ClientError(f"batch {running[0]} of the retry chain is still running; merge once it has ended")
    folder, names = local_results(output)
    out_path, err_path = folder.folder / names.output, folder.folder / names.of("errors.jsonl")
    with tempfile.TemporaryDirectory(prefix="bulkgen-merge-") as tmp, contextlib.ExitStack() as files:

        def fetch(file_id: str | None):
            path = Path(tmp) / (file_id or "none")
            with path.open("wb") as f:
                if file_id:
                    with client.files.with_streaming_response.content(file_id) as response:
                        for chunk in response.iter_bytes():
                            f.write(chunk)
            return files.enter_context(path.open("rb"))

        source = fetch(chain[0].input_file_id)
        results = [(fetch(b.output_file_id), fetch(b.error_file_id)) for b in chain]
        with folder.open(names.output) as out, folder.open(names.of("errors.jsonl")) as err:
            try:
                counts = merge_chain(source, results, out, err)
            except ValueError as exc:
                raise ClientError(str(exc)) from None
    ids = " -> ".join(b.id for b in chain)
    return [f"{out_path} ({counts.succeeded} lines)", f"{err_path} ({counts.failed} lines)", f"across {ids}"]
