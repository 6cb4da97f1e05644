"""`bulkgen run`: one batch, in this process, on the embedded defaults, with the service's exact path.

It goes through the same storage records, validation, runner and workers as `bulkgen serve`, so what
works here works behind the API.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import click

from bulkgen.batch.responses import answer_summary
from bulkgen.batch.schema import BatchStatus, InvalidRequest
from bulkgen.batch.service import BatchService
from bulkgen.client import ClientError, detect_endpoint, endpoint_of, output_paths
from bulkgen.metrics.table import describe_summary
from bulkgen.plan.admission import WorkTally, estimate_into
from bulkgen.runtime.manager import BatchManager
from bulkgen.settings import Settings
from bulkgen.store import NotFound
from bulkgen.watch.outputs import stem_of, write_results

HEAD_START_S = 0.5  # validation's head start: a small broken file is reported before Ray starts


class OneShotError(Exception):
    """Bad input or a failed batch, explained in words."""


def accept(svc: BatchService, fileobj: BinaryIO, name: str, endpoint: str, window: str) -> dict:
    """Store the file and create its batch, as `POST /v1/files` and `/v1/batches` do, then validate it here
    with the runtime's own step (`svc.validate`), so bad input is told before any worker starts."""
    try:
        record = svc.create_batch(svc.files.create(fileobj, name, "batch")["id"], endpoint, window, None)
        tally = WorkTally()
        record = svc.validate(record["id"], on_request=tally.add, amend=estimate_into(svc, tally, queued_requests=0))
    except InvalidRequest as exc:
        raise OneShotError(str(exc)) from None
    if record["status"] == BatchStatus.FAILED:
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
    progress = _Progress()

    def announce(record: dict) -> None:
        echo(f"{record['id']}: {record['request_counts']['total']} requests for {record['model']} ({endpoint})")
        progress.open(record["request_counts"]["total"])

    try:
        with file.open("rb") as f:
            record = run_batch(svc, f, str(file), endpoint, window, announce=announce, on_poll=progress.show)
    finally:
        progress.close()
    _write_results(svc, record, output, echo)
    return record


def run_batch(svc: BatchService, fileobj: BinaryIO, name: str, endpoint: str, window: str,
              announce: Callable[[dict], None] | None = None,
              on_poll: Callable[[dict], None] | None = None) -> dict:
    """Store, validate and run one batch in this process, to its end. Ray, the workers and the served
    model (when one is served) start while the file is stored and validated: most of a run's fixed
    cost is theirs. A file whose validation fails within HEAD_START_S is reported before Ray starts."""
    accepted: dict = {}

    def validate() -> None:
        try:
            accepted["record"] = accept(svc, fileobj, name, endpoint, window)
        except BaseException as exc:  # raised in the caller's thread below
            accepted["error"] = exc

    thread = threading.Thread(target=validate, name="bulkgen-validate", daemon=True)
    thread.start()
    thread.join(HEAD_START_S)
    if "error" in accepted:
        raise accepted["error"]
    manager = BatchManager(svc, only=set())  # Ray starts in the calling thread (its signal handlers need it)
    try:
        manager.start()
        if len(svc.settings.models) == 1:
            manager.dispatcher.preload(*next(iter(svc.settings.models.items())))
        thread.join()
        if "error" in accepted:
            raise accepted["error"]
        record = accepted["record"]
        if announce is not None:
            announce(record)
        manager.only.add(record["id"])
        manager.wake()
        return manager.wait(record["id"], on_poll=on_poll)
    finally:  # the workers may be shared with a service on the same Ray: leave them running
        thread.join()
        manager.stop(kill_workers=False)


def run_stored(settings: Settings, input_key: str, output_prefix: str, endpoint: str | None = None,
               window: str = "24h", echo: Callable[[str], None] = print) -> dict:
    """A JSONL file already in storage (e.g. dropped under inbox/) run as a batch; results copied beside
    it under `output_prefix` as <name>.output.jsonl / <name>.errors.jsonl / <name>.summary.json (the
    writer `bulkgen watch` uses too: bulkgen/watch/outputs.py)."""
    svc = BatchService(settings)

    def announce(record: dict) -> None:
        echo(f"{record['id']}: {record['request_counts']['total']} requests from {input_key}")

    try:
        endpoint = endpoint or endpoint_of(svc.store.iter_lines(input_key), input_key)
        with svc.store.open_read(input_key) as f:
            record = run_batch(svc, f, input_key, endpoint, window, announce=announce)
    except (ClientError, NotFound) as exc:
        raise OneShotError(f"{input_key}: {exc}") from None
    stem = f"{output_prefix.rstrip('/')}/{stem_of(input_key.rsplit('/', 1)[-1])}"
    write_results(svc, record, svc.store, stem, source={"key": input_key})
    echo(f"{record['id']} {record['status']}: results under {stem}.*")
    return record


class _Progress:
    """`bulkgen run`'s progress bar over settled requests; opened once the batch's size is known."""

    def __init__(self) -> None:
        self.bar = None
        self.done = 0

    def open(self, total: int) -> None:
        self.bar = click.progressbar(length=total, label="requests", show_pos=True, show_eta=False)
        self.bar.__enter__()

    def show(self, record: dict) -> None:
        counts = record["request_counts"]
        if self.bar is not None:
            self.bar.update(counts["completed"] + counts["failed"] - self.done)
            self.done = counts["completed"] + counts["failed"]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


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
