"""Cancelling a long batch early costs what its error file must hold, not a part per unrun range.

A 100,000-line batch on moto's S3 (behind the counting proxy of tests/support/s3.py) with three ranges
finished, scattered as the queue hands them out, is cancelled and finalized (what the runner does once its
workers stored what they held): the unrun requests' error lines come from the input in one streamed pass
(bulkgen.runtime.not_run), in input order among the parts' own, and the requests counted are the input
read a window at a time, the three parts, and the two files written."""

from __future__ import annotations

import io
import json
import time

import numpy as np

from bulkgen.batch import lifecycle
from bulkgen.batch.service import BatchService
from bulkgen.runtime import not_run, parts
from bulkgen.runtime.finalize import finalize
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.settings import Settings
from bulkgen.store import open_store
from tests.support.s3 import FAST_RETRY, tally

LINES = 100_000
DONE = [(1, 32), (5_001, 5_032), (40_001, 40_032)]  # input lines with a part when the cancel lands


def _row(n: int) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": f"label item {n}"}], "max_tokens": 1}
    row = {"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(row).encode() + b"\n"


def _input() -> tuple[bytes, LineIndex]:
    """The input file (line 7 blank: no request) and its line index."""
    rows = [b"\n" if n == 7 else _row(n) for n in range(1, LINES + 1)]
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    keep = lengths > 1
    count = int(keep.sum())
    index = LineIndex(
        np.arange(1, LINES + 1, dtype=np.uint32)[keep],
        starts[keep],
        (lengths[keep] - 1).astype(np.uint32),
        np.ones(count, dtype=np.uint32),
        np.zeros(count, dtype=np.uint64),
    )
    return b"".join(rows), index


def _cancelled_batch(svc: BatchService, data: bytes) -> str:
    file_id = svc.files.create(io.BytesIO(data), "in.jsonl", "batch")["id"]
    batch_id = svc.create_batch(file_id, "/v1/chat/completions", "24h", None).id
    svc.batches.update(batch_id, lambda r: lifecycle.transition(r, "in_progress"))
    svc.batches.update(batch_id, lifecycle.cancel)
    for first, last in DONE:
        entries = [
            parts.PartEntry.of(n, n % 10 != 3, {"custom_id": f"r{n}", "answer": n}, (4, 1, 0, 0))
            for n in range(first, last + 1)
            if n != 7
        ]
        parts.write_part(svc.store, batch_id, first, last, entries)
    return batch_id


def test_cancel_reads_the_input_once_and_writes_no_part(s3_bucket_url, flaky_proxy):
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, **FAST_RETRY)
    svc = BatchService(Settings(storage=s3_bucket_url), store=store)
    data, index = _input()
    batch_id = _cancelled_batch(svc, data)

    start, began = len(flaky_proxy.log), time.monotonic()
    record = finalize(svc, batch_id, "batch_cancelled", None, index)
    seconds = time.monotonic() - began
    requests = tally(flaky_proxy.log[start:])

    assert record.status == "cancelled"
    output = svc.store.read_bytes(svc.files.data_key(record.output_file_id)).splitlines()
    errors = [
        json.loads(x) for x in svc.store.read_bytes(svc.files.data_key(record.error_file_id)).splitlines()
    ]
    done = [n for first, last in DONE for n in range(first, last + 1) if n != 7]
    assert [json.loads(x)["answer"] for x in output] == [n for n in done if n % 10 != 3]
    wanted = [n for n in range(1, LINES + 1) if n != 7 and (n not in done or n % 10 == 3)]
    assert [int(e["custom_id"][1:]) for e in errors] == wanted  # input order, the parts' errors among them
    cancelled = [e for e in errors if e.get("error")]
    assert len(cancelled) == len(index) - len(done)
    assert all(e["response"] is None and e["error"]["code"] == "batch_cancelled" for e in cancelled)
    counts = record.request_counts
    assert (counts.completed, counts.failed) == (len(output), len(errors))

    # the input read a window at a time, each part once; the output and error files (multipart uploads
    # of a few parts each) and the records: no part written for the unrun requests
    windows = -(-len(data) // not_run.WINDOW)
    assert requests["get"] <= windows + len(DONE) + 8, requests
    assert requests["put"] <= 20, requests
    assert requests["list"] <= 3, requests
    print(f"cancel of {LINES:,} lines: {dict(requests)} in {seconds:.2f} s")


def test_an_expired_batchs_unrun_lines_fill_every_gap_in_input_order(tmp_path):
    """On a local folder, with a window of a few lines (so the gaps take several reads): requests before the
    first part, between parts, inside a retried range's overlap and after the last part each appear once,
    `batch_expired`, where the input has them; a part's own lines are never written twice."""
    store = open_store(str(tmp_path / "store"))
    store.create()
    data, index = _input()
    for first, last in [(11, 20), (15, 30), (51, 60), (90, 95)]:  # 15-30: a retried range across 11-20's end
        entries = [
            parts.PartEntry.of(n, True, {"custom_id": f"r{n}", "answer": n}) for n in range(first, last + 1)
        ]
        parts.write_part(store, "batch_x", first, last, entries)
    hundred = 99  # requests on lines 1-100 (line 7 is blank)
    store.write_bytes("input.jsonl", data[: int(index.starts[hundred])])
    columns = (index.lines, index.starts, index.lengths, index.work, index.prefix)
    head = LineIndex(*(column[:hundred] for column in columns))
    gaps = not_run.NotRun(store, "input.jsonl", head, "batch_expired", window=300)
    errors, tally_ = io.BytesIO(), parts.Tally()
    output = b"".join(parts.merge_parts(store, "batch_x", errors, tally_, not_run=gaps))
    answered = [json.loads(x)["answer"] for x in output.splitlines()]
    assert answered == [*range(11, 31), *range(51, 61), *range(90, 96)]
    expired = [json.loads(x) for x in errors.getvalue().splitlines()]
    assert [e["custom_id"] for e in expired] == [
        f"r{n}" for n in [*range(1, 11), *range(31, 51), *range(61, 90), *range(96, 101)] if n != 7
    ]
    assert {e["error"]["code"] for e in expired} == {"batch_expired"}
    assert (tally_.completed, tally_.failed) == (len(answered), len(expired))
