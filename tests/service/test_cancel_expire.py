"""Cancel and expiry keep finished work: partial output file, the rest in the error file.

The long requests are held at the test engine's gate (tests/support/held_engine.py), so they are still in
progress when the batch is cancelled or expires, however fast the machine runs them."""

from __future__ import annotations

import time

from bulkgen.batch.batchrecord import BatchRecord
from tests.support.held_engine import HOLD
from tests.support.service import chat_row, read_lines, upload, wait_done, wait_for, write_jsonl

LONG, SHORT = 6, 40


def _mixed_batch(client, tmp_path, gate):
    """A few held requests that keep the batch open, and many short ones that finish at once."""
    rows = [chat_row(f"long-{i}", f"{HOLD} story {i}", max_tokens=256) for i in range(LONG)]
    rows += [chat_row(f"short-{i}", f"label {i}", max_tokens=2) for i in range(SHORT)]
    file_id = upload(client, write_jsonl(tmp_path / "mixed.jsonl", rows)).id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    gate.wait_held()
    return wait_for(client, batch.id, lambda b: b.request_counts.completed >= SHORT // 2)


def _check_partial(client, batch, code: str) -> None:
    counts = batch.request_counts
    assert counts.total == LONG + SHORT and counts.completed + counts.failed == counts.total
    done = read_lines(client, batch.output_file_id)
    errors = read_lines(client, batch.error_file_id)
    assert len(done) == counts.completed >= SHORT // 2
    assert all(line["response"]["status_code"] == 200 for line in done)
    assert len(errors) == counts.failed >= 1
    assert all(e["response"] is None and e["error"]["code"] == code for e in errors)
    ids = {line["custom_id"] for line in done + errors}
    assert len(ids) == LONG + SHORT  # every request accounted for exactly once


def test_cancel_keeps_partial_results(client, tmp_path, engine_gate):
    batch = _mixed_batch(client, tmp_path, engine_gate)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    batch = wait_done(client, batch.id, timeout=60)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    long_errors = [e for e in read_lines(client, batch.error_file_id) if e["custom_id"].startswith("long-")]
    assert len(long_errors) == LONG  # the held requests were aborted, not run to their end
    _check_partial(client, batch, "batch_cancelled")


def test_expiry_keeps_partial_results(service, client, tmp_path, engine_gate):
    batch = _mixed_batch(client, tmp_path, engine_gate)

    def expire_now(record: BatchRecord) -> BatchRecord:
        record.expires_at = int(time.time())
        return record

    service.svc.batches.update(batch.id, expire_now)  # the record in storage is the source of truth
    batch = wait_done(client, batch.id, timeout=60)
    assert batch.status == "expired" and batch.expired_at is not None
    _check_partial(client, batch, "batch_expired")
