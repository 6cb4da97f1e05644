"""The one writer of a batch's result files, and their names: `bulkgen run -o`, `bulkgen watch`,
`jobs/batch_job.py` and `bulkgen results` (plain or `--merged`) all name and write them here.

Every name is a *stem* and a suffix saying what the file holds, so a folder of results sorts by input and
the files of one batch sit together:

    <stem>.output.jsonl   <stem>.errors.jsonl    the batch's output and error files (format jsonl), or
    <stem>.output.parquet                        one row per request, completed and failed (format parquet)
    <stem>.errors.json    the batch's validation errors (a file refused before any request ran)
    <stem>.metrics.json   the batch's metrics (`bulkgen run`, which prints the rest to the terminal)
    <stem>.summary.json   status, counts, usage, metrics, and what was written (stored batches)
    <stem>.report.json    an object that is no batch file at all (not *.jsonl, not JSON lines), and why

A stored batch's stem is its input's key without `.jsonl` (`2026/day1.jsonl` -> `2026/day1`: results keep
the input's folders, so equal names never collide). Where the user names the output file (`-o
results.jsonl`, `--output`, `--merged`), that name is kept as it is, and the stem is that name without
`.jsonl`: the errors go to `results.errors.jsonl`, beside it, under the same rule as a stored batch's.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.outputlines import answer_summary
from bulkgen.batch.service import BatchService
from bulkgen.store import Store

FORMATS = ("jsonl", "parquet")
PARQUET_ROWS_PER_GROUP = 10_000


def stem_of(key: str) -> str:
    """'2026/day1.jsonl' -> '2026/day1'."""
    return key.removesuffix(".jsonl")


@dataclass(frozen=True)
class ResultNames:
    """The names of one batch's result files (the module's docstring says why they are these)."""

    stem: str
    chosen_output: str | None = None  # the output file's name where the user chose it

    @classmethod
    def of_output(cls, output: str) -> ResultNames:
        """The names beside an output file the user named: 'results.jsonl' -> results.errors.jsonl, ..."""
        return cls(stem_of(output), output)

    @property
    def output(self) -> str:
        return self.chosen_output or f"{self.stem}.output.jsonl"

    def of(self, kind: str) -> str:
        """'errors.jsonl', 'output.parquet', 'errors.json', 'metrics.json', 'summary.json', 'report.json'."""
        return f"{self.stem}.{kind}"


class LocalFolder:
    """Plain files under a local folder, written the way a Store is (`upload_fileobj`, `write_bytes`), for
    results on the user's disk: no storage bookkeeping beside them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def open(self, name: str) -> BinaryIO:
        """A result file to write as a stream (a merge writes its lines as it goes)."""
        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("wb")

    def upload_fileobj(self, name: str, src: BinaryIO) -> None:
        with self.open(name) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.upload_fileobj(name, io.BytesIO(data))


def local_results(output: Path) -> tuple[LocalFolder, ResultNames]:
    """Where and under which names the results of a user-named output file go (beside it)."""
    return LocalFolder(output.parent), ResultNames.of_output(output.name)


def write_results(
    svc: BatchService,
    record: BatchRecord,
    out: Store | LocalFolder,
    names: ResultNames | str,
    fmt: str = "jsonl",
    source: dict | None = None,
    summarize: bool = True,
) -> list[str]:
    """Write an ended batch's results in `out` (`names`: a ResultNames or a stem); -> the names written
    (summary last). `summarize=False` (`bulkgen run`, which prints the rest): output, errors and metrics."""
    if fmt not in FORMATS:
        raise ValueError(f"output format must be one of {FORMATS}, got {fmt!r}")
    names = ResultNames(names) if isinstance(names, str) else names
    written = []
    if fmt == "parquet" and (record.output_file_id or record.error_file_id):
        written.append(_write_parquet(svc, record, out, names.of("output.parquet")))
    elif fmt == "jsonl":
        for file_id, name in (
            (record.output_file_id, names.output),
            (record.error_file_id, names.of("errors.jsonl")),
        ):
            if file_id:
                with svc.files.open(file_id) as src:
                    out.upload_fileobj(name, src)
                written.append(name)
    if not summarize:
        if record.metrics:
            written.append(names.of("metrics.json"))
            out.write_bytes(written[-1], json.dumps(record.metrics, indent=2).encode())
        return written
    if record.errors:
        out.write_bytes(names.of("errors.json"), _dumps(record.errors))
        written.append(names.of("errors.json"))
    written.append(names.of("summary.json"))
    out.write_bytes(written[-1], _dumps(summary(record, written[:-1], source)))
    return written


def summary(record: BatchRecord, written: list[str], source: dict | None = None) -> dict:
    view = record.public()
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
    key = ResultNames(stem).of("report.json")
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


def _write_parquet(svc: BatchService, record: BatchRecord, out: Store | LocalFolder, key: str) -> str:
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


def _rows(svc: BatchService, record: BatchRecord) -> Iterator[dict]:
    for file_id in (record.output_file_id, record.error_file_id):
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
