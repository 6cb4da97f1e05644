"""Publication order under a real BatchManager: an active-index entry is never acted on before its record.

The storage is a real LocalStore whose writes the test holds at gates (tests/support/gated_store.py), so
the slow record write of a busy machine or an S3 latency spike happens exactly where the test wants it.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time

import pytest

from bulkgen.batch.batchrecord import new_batch_record
from bulkgen.batch.ids import new_id
from bulkgen.batch.service import BatchService
from bulkgen.runtime.manager import BatchManager
from tests.support.gated_store import GatedStore
from tests.support.service import chat_row, settings_for, stop_manager
from tests.support.wait import wait_until

ROWS = b"".join(json.dumps(chat_row(f"r{i}", f"hi {i}", max_tokens=2)).encode() + b"\n" for i in range(3))


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    root = tmp_path_factory.mktemp("order") / "store"
    root.mkdir()
    store = GatedStore(root, fsync=False)
    svc = BatchService(settings_for(str(root)), store=store)
    manager = BatchManager(svc)
    manager.start()
    yield store, svc, manager
    stop_manager(manager)  # the session's workers, if it runs, stay up


def _upload(svc: BatchService) -> str:
    return svc.files.create(io.BytesIO(ROWS), "in.jsonl", "batch")["id"]


def _scans(store: GatedStore) -> int:
    return store.calls[("list", "active/")]


def _wait_scans(store: GatedStore, manager: BatchManager, count: int, until=lambda: False) -> None:
    """`count` more manager scans (woken at once, not waited for), or until `until()` holds."""
    target = _scans(store) + count

    def scanned() -> bool:
        if _scans(store) >= target or until():
            return True
        manager.wake()
        return False

    wait_until(scanned, 60, "the manager's next scans", interval=0.01)


def test_a_batch_whose_record_write_is_slow_completes(running):
    store, svc, manager = running
    file_id = _upload(svc)
    gate = store.gate("write", r"batches/.*\.json")
    missed = threading.Event()

    def record_lands_now(key: str) -> None:  # a runner looked for the record: let the write land meanwhile
        if key.startswith("batches/") and not missed.is_set():
            missed.set()
            gate.open()
            assert gate.passed.wait(60)

    store.on_miss = record_lands_now
    created: list[dict] = []
    creator = threading.Thread(
        target=lambda: created.append(svc.create_batch(file_id, "/v1/chat/completions", "24h", None))
    )
    try:
        creator.start()
        gate.wait_reached()  # the creator is writing the record, slowly
        _wait_scans(store, manager, 2, until=missed.is_set)
        gate.open()
        creator.join(60)
    finally:
        store.on_miss = None
        gate.open()
    record = manager.wait(created[0].id, poll_s=0.1)
    assert record.status == "completed", record.errors
    assert record.request_counts.completed == 3


def test_an_index_entry_without_its_record_is_not_a_failure(running, caplog):
    store, svc, manager = running
    file_id = _upload(svc)
    record = new_batch_record(file_id, "/v1/chat/completions", "24h", None)
    caplog.set_level(logging.ERROR)
    store.write_bytes(f"active/{record.id}", b"")  # the entry alone, as a creator between writes leaves it
    _wait_scans(store, manager, 3)
    assert manager.runner_of(record.id) is None and not store.exists(f"batches/{record.id}.json")
    assert store.exists(f"active/{record.id}")  # still waiting for its record
    assert not any(record.id in r.getMessage() for r in caplog.records), caplog.text
    svc.batches.create(record)  # the record lands: the next scan runs the batch
    done = manager.wait(record.id, poll_s=0.1)
    assert done.status == "completed", done.errors


def test_an_index_entry_whose_record_never_came_is_dropped_after_a_grace(running):
    store, svc, manager = running
    stale = new_id("batch_", now=time.time() - 3600)  # its creator died an hour ago, between the writes
    store.write_bytes(f"active/{stale}", b"")

    def dropped() -> bool:
        manager.wake()
        return not store.exists(f"active/{stale}")

    wait_until(dropped, 60, "a dead creator's index entry to be dropped (not retried forever)", interval=0.05)
    assert not store.exists(f"leases/{stale}.json") and not store.exists(f"batches/{stale}.json")
