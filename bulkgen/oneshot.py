"""`bulkgen run`: one batch, in this process, on the embedded defaults, with the service's exact path.

It goes through the same storage records, validation, runner and workers as `bulkgen serve`, so what
works here works behind the API.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import click

from bulkgen.batch.responses import answer_summary
from bulkgen.batch.schema import InvalidRequest
from bulkgen.batch.service import BatchService
from bulkgen.client import ClientError, detect_endpoint, endpoint_of, output_paths
from bulkgen.metrics.table import describe_summary
from bulkgen.plan.admission import WorkTally, add_estimate
from bulkgen.runtime.manager import BatchManager
from bulkgen.settings import Settings
from bulkgen.store import NotFound
from bulkgen.watch.outputs import stem_of, write_results


class OneShotError(Exception):
    """Bad input or a failed batch, explained in words."""


def accept(svc: BatchService, fileobj: BinaryIO, name: str, endpoint: str, window: str) -> dict:
    """Store the file and create its batch, as `POST /v1/files` and `/v1/batches` do, then validate it here
    with the runtime's own step (`svc.validate`), so bad input is told before any worker starts."""
    try:
        record = svc.create_batch(svc.files.create(fileobj, name, "batch")["id"], endpoint, window, None)
        tally = WorkTally()
        record = svc.validate(record["id"], on_request=tally.add)
        if record["status"] == "in_progress":
            record = add_estimate(svc, record["id"], tally, queued_requests=0)
    except InvalidRequest as exc:
        raise OneShotError(str(exc)) from None
    if record["status"] == "failed":
        lines = "\n".join(f"  {name}:{e['line']}: [{e['code']}] {e['message']}" if e["line"] else
                           f"  {name}: [{e['code']}] {e['message']}" for e in record["errors"]["data"])
        raise OneShotError(f"{name} failed validation:\n{lines}")
    return record


def run_file(settings: Settings, file: Path, output: Path, endpoint: str | None, window: str,
             echo: Callable[[str], None] = print) -> dict:
    """`bulkgen run`: a local JSONL file in, local result files out."""
    svc = BatchService(settings)
    try:
        endpoint = endpoint or detect_endpoint(file)
    except ClientError as exc:
        raise OneShotError(str(exc)) from None
    with file.open("rb") as f:
        record = accept(svc, f, str(file), endpoint, window)
    echo(f"{record['id']}: {record['request_counts']['total']} requests for {record['model']} ({endpoint})")
    record = _run_with_progress(svc, record)
    _write_results(svc, record, output, echo)
    return record


def run_accepted(svc: BatchService, batch_id: str, on_poll: Callable[[dict], None] | None = None) -> dict:
    """Run one accepted batch in this process to its end (Ray starts here, in the calling thread)."""
    manager = BatchManager(svc, only={batch_id})
    manager.start()
    try:
        return manager.wait(batch_id, on_poll=on_poll)
    finally:  # the workers may be shared with a service on the same Ray: leave them running
        manager.stop(kill_workers=False)


def run_stored(settings: Settings, input_key: str, output_prefix: str, endpoint: str | None = None,
               window: str = "24h", echo: Callable[[str], None] = print) -> dict:
    """A JSONL file already in storage (e.g. dropped under inbox/) run as a batch; results copied beside
    it under `output_prefix` as <name>.output.jsonl / <name>.errors.jsonl / <name>.summary.json (the
    writer `bulkgen watch` uses too: bulkgen/watch/outputs.py)."""
    svc = BatchService(settings)
    try:
        endpoint = endpoint or endpoint_of(svc.store.iter_lines(input_key), input_key)
        with svc.store.open_read(input_key) as f:
            record = accept(svc, f, input_key, endpoint, window)
    except (ClientError, NotFound) as exc:
        raise OneShotError(f"{input_key}: {exc}") from None
    echo(f"{record['id']}: {record['request_counts']['total']} requests from {input_key}")
    record = run_accepted(svc, record["id"])
    stem = f"{output_prefix.rstrip('/')}/{stem_of(input_key.rsplit('/', 1)[-1])}"
    write_results(svc, record, svc.store, stem, source={"key": input_key})
    echo(f"{record['id']} {record['status']}: results under {stem}.*")
    return record


def _run_with_progress(svc: BatchService, record: dict) -> dict:
    total = record["request_counts"]["total"]
    with click.progressbar(length=total, label="requests", show_pos=True, show_eta=False) as bar:
        seen = {"done": 0}

        def show(current: dict) -> None:
            counts = current["request_counts"]
            bar.update(counts["completed"] + counts["failed"] - seen["done"])
            seen["done"] = counts["completed"] + counts["failed"]

        return run_accepted(svc, record["id"], on_poll=show)


def _write_results(svc: BatchService, record: dict, output: Path, echo: Callable[[str], None]) -> None:
    out_path, err_path = output_paths(output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    counts = record["request_counts"]
    echo(f"{record['id']} {record['status']}: {counts['completed']} completed, {counts['failed']} failed")
    for file_id, path in ((record["output_file_id"], out_path), (record["error_file_id"], err_path)):
        if file_id:
            with svc.files.open(file_id) as src, path.open("wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            echo(f"wrote {path}")
    if record["output_file_id"]:
        echo(_preview(out_path))
    metrics = record.get("metrics")
    if metrics:
        metrics_path = out_path.with_name(out_path.name.removesuffix(".jsonl") + ".metrics.json")
        metrics_path.write_text(json.dumps(metrics, indent=2))
        echo(f"wrote {metrics_path}")
        echo(describe_summary(metrics))
    if record["errors"]:
        echo(json.dumps(record["errors"]))


def _preview(path: Path, count: int = 3) -> str:
    """The first few answers, so a user sees what came back without opening the file."""
    lines = []
    with path.open() as f:
        for raw, _ in zip(f, range(count), strict=False):
            entry = json.loads(raw)
            body = entry["response"]["body"]
            summary = answer_summary(body)
            if summary["text"] is None:
                lines.append(f"  {entry['custom_id']}: {summary['vectors']} vector(s) of {summary['dimensions']} values")
                continue
            text = summary["text"]
            lines.append(f"  {entry['custom_id']}: {text[:70]!r}")
    return "first results:\n" + "\n".join(lines)
