"""What a stored batch leaves under an output prefix, named after its input: the one writer of these.

    <stem>.output.jsonl   <stem>.errors.jsonl    the batch's output and error files (format jsonl), or
    <stem>.output.parquet                        one row per request, completed and failed (format parquet)
    <stem>.errors.json    the batch's validation errors (a file refused before any request ran)
    <stem>.summary.json   status, counts, usage, metrics, and what was written
    <stem>.report.json    an object that is no batch file at all (not *.jsonl, not JSON lines), and why

`bulkgen watch` and `jobs/batch_job.py` (through bulkgen.cli.oneshot.run_stored) both write through here.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator

from bulkgen.batch.responses import answer_summary
from bulkgen.batch.schema import public_view
from bulkgen.batch.service import BatchService
from bulkgen.store import Store

FORMATS = ("jsonl", "parquet")
PARQUET_ROWS_PER_GROUP = 10_000


def stem_of(key: str) -> str:
    """'2026/day1.jsonl' -> '2026/day1': results keep the input's folders, so equal names never collide."""
    return key.removesuffix(".jsonl")


def write_results(
    svc: BatchService, record: dict, out: Store, stem: str, fmt: str = "jsonl", source: dict | None = None
) -> list[str]:
    """Write an ended batch's results under `stem` in `out`; -> the keys written (summary last)."""
    if fmt not in FORMATS:
        raise ValueError(f"output format must be one of {FORMATS}, got {fmt!r}")
    written = []
    if fmt == "parquet" and (record["output_file_id"] or record["error_file_id"]):
        written.append(_write_parquet(svc, record, out, f"{stem}.output.parquet"))
    elif fmt == "jsonl":
        for file_id, suffix in (
            (record["output_file_id"], "output.jsonl"),
            (record["error_file_id"], "errors.jsonl"),
        ):
            if file_id:
                with svc.files.open(file_id) as src:
                    out.upload_fileobj(f"{stem}.{suffix}", src)
                written.append(f"{stem}.{suffix}")
    if record["errors"]:
        out.write_bytes(f"{stem}.errors.json", _dumps(record["errors"]))
        written.append(f"{stem}.errors.json")
    written.append(f"{stem}.summary.json")
    out.write_bytes(written[-1], _dumps(summary(record, written[:-1], source)))
    return written


def summary(record: dict, written: list[str], source: dict | None = None) -> dict:
    view = public_view(record)
    keep = (
        "id",
        "status",
        "endpoint",
        "model",
        "request_counts",
        "usage",
        "metrics",
        "errors",
        "created_at",
        "in_progress_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelled_at",
    )
    return {"batch": {k: view.get(k) for k in keep}, "source": source, "written": written}


def write_report(out: Store, stem: str, reason: str, source: dict | None = None) -> str:
    """An object that is not a batch file: say why, instead of running it."""
    key = f"{stem}.report.json"
    out.write_bytes(key, _dumps({"status": "not_run", "reason": reason, "source": source}))
    return key


def _dumps(value) -> bytes:
    return json.dumps(value, indent=2, ensure_ascii=False).encode() + b"\n"


# -- Parquet ------------------------------------------------------------------------------------------
def _schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("custom_id", pa.string()),
            ("status", pa.string()),
            ("text", pa.string()),
            ("finish_reason", pa.string()),
            ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),
            ("error_code", pa.string()),
            ("error_message", pa.string()),
        ]
    )


def _write_parquet(svc: BatchService, record: dict, out: Store, key: str) -> str:
    """Completed requests (in input order), then failed ones; the first choice's text when n > 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema()
    with tempfile.TemporaryFile() as tmp:
        with pq.ParquetWriter(tmp, schema) as writer:
            rows: list[dict] = []
            for row in _rows(svc, record):
                rows.append(row)
                if len(rows) == PARQUET_ROWS_PER_GROUP:
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                    rows = []
            if rows:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
        tmp.seek(0)
        out.upload_fileobj(key, tmp)
    return key


def _rows(svc: BatchService, record: dict) -> Iterator[dict]:
    for file_id in (record["output_file_id"], record["error_file_id"]):
        if file_id:
            for raw in svc.files.iter_lines(file_id):
                if raw.strip():
                    yield parquet_row(json.loads(raw))


def parquet_row(line: dict) -> dict:
    """One output or error line (the hosted API's envelope) as a flat row."""
    row = {
        "custom_id": line["custom_id"],
        "status": "failed",
        "text": None,
        "finish_reason": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "error_code": None,
        "error_message": None,
    }
    response, error = line.get("response"), line.get("error")
    body = response["body"] if response else {}
    if response and response.get("status_code") == 200:
        summary = answer_summary(body)
        row.update(
            status="completed",
            text=summary["text"],
            finish_reason=summary["finish_reason"],
            prompt_tokens=summary["prompt_tokens"],
            completion_tokens=summary["completion_tokens"],
        )
    else:
        error = error or body.get("error") or {}
        row["error_code"], row["error_message"] = error.get("code"), error.get("message")
    return row
