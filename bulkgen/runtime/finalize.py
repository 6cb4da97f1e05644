"""Finalize a batch once: merge its parts into output and error files, store the report, close it.

The output and error files get ids derived from the batch id, so a finalize that is retried (its
runner died half way) overwrites the same files instead of leaving orphans, and the closing status
change is conditional: a batch already ended is never closed twice. Once the batch is closed its
parts are deleted (a finalize that dies before leaves them to `bulkgen gc`).
"""

from __future__ import annotations

from bulkgen.batch import lifecycle
from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.schema import TERMINAL_STATUSES
from bulkgen.batch.service import BatchService
from bulkgen.metrics import BatchMetrics, report_files
from bulkgen.runtime import parts
from bulkgen.store import layout


def result_file_ids(batch_id: str) -> tuple[str, str]:
    stem = batch_id.removeprefix("batch_")
    return f"file-{stem}-output", f"file-{stem}-errors"


def finalize(
    svc: BatchService, batch_id: str, stop: str | None, metrics: BatchMetrics | None = None
) -> BatchRecord:
    if stop is None:
        record = svc.batches.update(batch_id, lifecycle.begin_finalizing)
    else:
        record = svc.batches.get(batch_id)
    expiry = record.internal.get("output_expires_after_s")  # the batch's output_expires_after
    outputs, errors, tally = parts.merge_parts(svc.store, batch_id)
    output_id, error_id = result_file_ids(batch_id)
    with outputs, errors:
        if tally.completed:
            svc.files.put(output_id, outputs, layout.output_filename(batch_id), "batch_output", expiry)
        if tally.failed:
            svc.files.put(error_id, errors, layout.error_filename(batch_id), "batch_output", expiry)
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


def _store_report(svc: BatchService, batch_id: str, metrics: BatchMetrics | None) -> dict | None:
    """report.json and report.png, kept with the batch's reports (layout.report)."""
    if metrics is None or not metrics.totals["requests"]:
        return None
    keys = {}
    for name, data in report_files(metrics).items():
        keys[name] = layout.report(batch_id, name)
        svc.store.write_bytes(keys[name], data)
    return {"summary": metrics.summary(), "files": keys}
