"""Finalize a batch once: merge its parts into output and error files, store the report, close it.

The output file is composed from ranges of its parts (`Store.compose`, `parts.merge_parts`): on S3 a long
part is copied server-side, never downloaded; elsewhere the parts are read READERS at a time and streamed.

The output and error files get ids derived from the batch id, so a finalize that is retried (its
runner died half way) overwrites the same files instead of leaving orphans, and the closing status
change is conditional: a batch already ended is never closed twice. A cancelled or expired batch's
requests that never ran get their error lines in the same pass, read from the input (not_run.py), never
as parts of their own. Once the batch is closed its parts are deleted (a finalize that dies before
leaves them to `bulkgen gc`).
"""

from __future__ import annotations

import tempfile

from bulkgen.batch import lifecycle
from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.schema import TERMINAL_STATUSES
from bulkgen.batch.service import BatchService
from bulkgen.metrics import BatchMetrics, report_files
from bulkgen.runtime import parts
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.runtime.not_run import NotRun
from bulkgen.store import layout


def result_file_ids(batch_id: str) -> tuple[str, str]:
    stem = batch_id.removeprefix("batch_")
    return f"file-{stem}-output", f"file-{stem}-errors"


def finalize(
    svc: BatchService,
    batch_id: str,
    stop: str | None,
    metrics: BatchMetrics | None = None,
    index: LineIndex | None = None,
) -> BatchRecord:
    """`stop` (batch_cancelled / batch_expired): the batch ends early, and each request of `index` that no
    part holds gets `stop` in the error file (bulkgen.runtime.not_run)."""
    if stop is None:
        record = svc.batches.update(batch_id, lifecycle.begin_finalizing)
    else:
        record = svc.batches.get(batch_id)
    output_id, error_id = result_file_ids(batch_id)
    not_run = None
    if stop is not None and index is not None:
        not_run = NotRun(svc.store, svc.files.data_key(record.input_file_id), index, stop)
    expiry = record.internal.get("output_expires_after_s")
    tally = _write_results(svc, batch_id, output_id, error_id, expiry, not_run)
    report = _store_report(svc, batch_id, metrics)

    def close(r: BatchRecord) -> BatchRecord | None:
        if r.status in TERMINAL_STATUSES:
            return None
        tally.apply(r)
        r.output_file_id = output_id if tally.completed else None
        r.error_file_id = error_id if tally.failed else None
        if report:
            r.metrics = {**(r.metrics or {}), **report["summary"], "report_files": report["files"]}
        return lifecycle.close(r, stop)

    record = svc.batches.update(batch_id, close)
    svc.mark_ended(batch_id, record)
    if record.status in TERMINAL_STATUSES:
        parts.delete_parts(svc.store, batch_id)
    return record


def _write_results(
    svc: BatchService,
    batch_id: str,
    output_id: str,
    error_id: str,
    expiry: int | None,
    not_run: NotRun | None,
) -> parts.Tally:
    """The output file composed from its parts' bytes (S3: long parts copied server-side), the error file
    from a spool; each file's record only if it has a line (an output without one is deleted)."""
    tally = parts.Tally()
    output_key = svc.files.data_key(output_id)
    with tempfile.SpooledTemporaryFile(max_size=parts.SPOOL_BYTES) as errors:
        size = svc.store.compose(
            output_key, parts.merge_parts(svc.store, batch_id, errors, tally, not_run=not_run)
        )
        if tally.completed:
            svc.files.write_meta(output_id, size, layout.output_filename(batch_id), "batch_output", expiry)
        else:
            svc.store.delete(output_key)
        if tally.failed:
            errors.seek(0)
            svc.files.put(error_id, errors, layout.error_filename(batch_id), "batch_output", expiry)
    return tally


def _store_report(svc: BatchService, batch_id: str, metrics: BatchMetrics | None) -> dict | None:
    """report.json and report.png, kept with the batch's reports (layout.report)."""
    if metrics is None or not metrics.totals["requests"]:
        return None
    keys = {}
    for name, data in report_files(metrics).items():
        keys[name] = layout.report(batch_id, name)
        svc.store.write_bytes(keys[name], data)
    return {"summary": metrics.summary(), "files": keys}
