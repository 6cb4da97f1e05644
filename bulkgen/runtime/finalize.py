"""Finalize a batch: merge result parts into the output and error files, store the report, close it."""

from __future__ import annotations

from bulkgen.batch.schema import set_status
from bulkgen.config import Context
from bulkgen.metrics import BatchMetrics, report_files
from bulkgen.runtime import parts

_FINAL_STATUS = {None: "completed", "batch_cancelled": "cancelled", "batch_expired": "expired"}


def finalize(ctx: Context, batch_id: str, stop: str | None, metrics: BatchMetrics | None = None) -> dict:
    """Idempotent: a runner resumed in `finalizing` simply merges the same parts again."""
    if stop is None:
        ctx.batches.update(batch_id, lambda r: set_status(r, "finalizing") if r["status"] == "in_progress" else None)
    outputs, errors, tally = parts.merge_parts(ctx.store, batch_id)
    output_id = ctx.files.create(outputs, f"{batch_id}_output.jsonl", "batch_output")["id"] if tally.completed else None
    error_id = ctx.files.create(errors, f"{batch_id}_error.jsonl", "batch_output")["id"] if tally.failed else None
    report = _store_report(ctx, batch_id, metrics)

    def close(r: dict) -> dict:
        tally.apply(r)
        r["output_file_id"], r["error_file_id"] = output_id, error_id
        if report:
            r["metrics"] = {**report["summary"], "report_files": report["files"]}
        if stop == "batch_cancelled" and r["cancelling_at"] is None:
            set_status(r, "cancelling")
        return set_status(r, _FINAL_STATUS[stop])

    return ctx.batches.update(batch_id, close)


def _store_report(ctx: Context, batch_id: str, metrics: BatchMetrics | None) -> dict | None:
    """report.json and report.png beside the output, under reports/<batch>/."""
    if metrics is None or not metrics.totals["requests"]:
        return None
    keys = {}
    for name, data in report_files(metrics).items():
        keys[name] = f"reports/{batch_id}/{name}"
        ctx.store.write_bytes(keys[name], data)
    return {"summary": metrics.summary(), "files": keys}
