"""`bulkgen run` and `jobs/batch_job.py`: one batch run in this process by the driver, to its end.

Both go through bulkgen.runtime.driver (the same storage records, validation, runner and workers as
`bulkgen serve`, so what works here works behind the API); what is theirs is where the input comes from
and where the results go: local files with a progress bar and a preview, or an output prefix in storage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.outputlines import answer_summary
from bulkgen.batch.resultfiles import local_results, stem_of, write_results
from bulkgen.batch.service import BatchService
from bulkgen.metrics.table import describe_summary
from bulkgen.runtime.driver import Driver, DriverError
from bulkgen.settings import Settings
from bulkgen.store import NotFound


class OneShotError(Exception):
    """Bad input or a failed batch, explained in words."""


def run_file(
    settings: Settings,
    file: Path,
    output: Path,
    endpoint: str | None,
    window: str,
    echo: Callable[[str], None] = print,
) -> BatchRecord:
    """`bulkgen run`: a local JSONL file in, local result files out."""
    svc = BatchService(settings)
    progress = _Progress()

    def announce(record: BatchRecord) -> None:
        echo(f"{record.id}: {record.request_counts.total} requests for {record.model} ({record.endpoint})")
        progress.open(record.request_counts.total)

    def write(record: BatchRecord) -> list[str]:
        progress.close()  # the bar's line ends before the summary
        return _write_results(svc, record, output, echo)

    try:
        with file.open("rb") as f:
            return Driver(svc).run(
                f, str(file), endpoint, window, write, announce=announce, on_poll=progress.show
            )
    except DriverError as exc:
        raise OneShotError(str(exc)) from None
    finally:
        progress.close()


def run_stored(
    settings: Settings,
    input_key: str,
    output_prefix: str,
    endpoint: str | None = None,
    window: str = "24h",
    echo: Callable[[str], None] = print,
) -> BatchRecord:
    """A JSONL file already in storage (e.g. dropped under inbox/) run as a batch; results copied beside
    it under `output_prefix` as <name>.output.jsonl / <name>.errors.jsonl / <name>.summary.json (the
    writer `bulkgen watch` uses too: bulkgen/batch/resultfiles.py)."""
    svc = BatchService(settings)
    stem = f"{output_prefix.rstrip('/')}/{stem_of(input_key.rsplit('/', 1)[-1])}"

    def announce(record: BatchRecord) -> None:
        echo(f"{record.id}: {record.request_counts.total} requests from {input_key}")

    def write(record: BatchRecord) -> list[str]:
        written = write_results(svc, record, svc.store, stem, source={"key": input_key})
        echo(f"{record.id} {record.status}: results under {stem}.*")
        return written

    try:
        with svc.store.open_read(input_key) as f:
            return Driver(svc).run(f, input_key, endpoint, window, write, announce=announce)
    except NotFound as exc:
        raise OneShotError(f"{input_key}: {exc}") from None
    except DriverError as exc:
        raise OneShotError(str(exc)) from None


class _Progress:
    """`bulkgen run`'s progress bar over settled requests; opened once the batch's size is known."""

    def __init__(self) -> None:
        self.bar = None
        self.done = 0

    def open(self, total: int) -> None:
        self.bar = click.progressbar(length=total, label="requests", show_pos=True, show_eta=False)
        self.bar.__enter__()

    def show(self, record: BatchRecord) -> None:
        counts = record.request_counts
        if self.bar is not None:
            self.bar.update(counts.completed + counts.failed - self.done)
            self.done = counts.completed + counts.failed

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _write_results(
    svc: BatchService, record: BatchRecord, output: Path, echo: Callable[[str], None]
) -> list[str]:
    counts = record.request_counts
    echo(f"{record.id} {record.status}: {counts.completed} completed, {counts.failed} failed")
    folder, names = local_results(output)
    written = write_results(svc, record, folder, names, summarize=False)
    for name in written:
        echo(f"wrote {output.parent / name}")
        if name == names.output:
            echo(_preview(output))
    if record.metrics:
        echo(describe_summary(record.metrics))
    if record.errors:
        echo(json.dumps(record.errors))
    return [str(output.parent / name) for name in written]


def _preview(path: Path, count: int = 3) -> str:
    """The first few answers, so a user sees what came back without opening the file."""
    lines = []
    with path.open() as f:
        for raw, _ in zip(f, range(count), strict=False):
            entry = json.loads(raw)
            body = entry["response"]["body"]
            summary = answer_summary(body)
            if summary["text"] is None:
                lines.append(
                    f"  {entry['custom_id']}: {summary['vectors']} vector(s) of {summary['dimensions']} values"
                )
                continue
            text = summary["text"]
            lines.append(f"  {entry['custom_id']}: {text[:70]!r}")
    return "first results:\n" + "\n".join(lines)
