"""The typed batch record: read and written in one place, byte for byte as stored records are; and the
status changes of bulkgen.batch.lifecycle, the only ones there are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bulkgen.batch import lifecycle
from bulkgen.batch.batchrecord import BatchRecord, RequestCounts, new_batch_record
from bulkgen.batch.lifecycle import ALLOWED, IllegalTransition, transition
from bulkgen.batch.records import BatchRepo
from bulkgen.batch.schema import TERMINAL_STATUSES, BatchStatus, Conflict
from bulkgen.store import LocalStore

# Records as the code before BatchRecord wrote them: a completed `bulkgen run` (metrics, usage, x_bulkgen)
# and a cancelled batch with metadata and output_expires_after.
STORED = sorted((Path(__file__).parent / "stored_records").glob("*.json"))


@pytest.mark.parametrize("path", STORED, ids=lambda p: p.stem)
def test_a_stored_record_reads_and_writes_back_byte_for_byte(path, tmp_path):
    raw = path.read_bytes()
    record = BatchRecord.from_json(json.loads(raw))
    assert json.dumps(record.to_json()).encode() == raw
    assert isinstance(record.status, BatchStatus) and isinstance(record.request_counts, RequestCounts)
    store = LocalStore(tmp_path / "s", fsync=False)
    store.create()
    repo = BatchRepo(store)
    store.write_bytes(repo.key(record.id), raw)
    assert repo.get(record.id) == record
    repo.update(record.id, lambda r: r)  # an update that changes nothing writes nothing
    assert store.read_bytes(repo.key(record.id)) == raw
    public = record.public()
    assert "x_bulkgen" not in public and list(public) == [k for k in json.loads(raw) if k != "x_bulkgen"]


def test_keys_this_version_does_not_know_are_kept():
    data = json.loads((Path(__file__).parent / "stored_records" / "completed.json").read_bytes())
    data["x_later_field"] = {"a": 1}
    assert BatchRecord.from_json(data).to_json() == data


def test_a_new_record_writes_the_hosted_apis_fields_in_order():
    record = new_batch_record("file-abc", "/chat/completions", "24h", {"k": "v"}, batch_id="batch_x")
    stored = record.to_json()
    old = json.loads((Path(__file__).parent / "stored_records" / "cancelling.json").read_bytes())
    assert list(stored) == list(old)  # the same keys in the same order as before
    assert stored["endpoint"] == "/v1/chat/completions" and stored["status"] == "validating"
    assert stored["expires_at"] - stored["created_at"] == 24 * 3600 and stored["x_bulkgen"] == {}


def test_an_update_changes_a_copy_and_stores_it(tmp_path):
    store = LocalStore(tmp_path / "s", fsync=False)
    store.create()
    repo = BatchRepo(store)
    record = repo.create(new_batch_record("file-abc", "/v1/completions", "24h", None))

    def start(r: BatchRecord) -> BatchRecord:
        r.request_counts.total = 3
        return transition(r, BatchStatus.IN_PROGRESS, now=1_800_000_000)

    started = repo.update(record.id, start)
    assert record.status == "validating" and record.request_counts.total == 0  # the caller's copy as it was
    stored = json.loads(store.read_bytes(repo.key(record.id)))
    assert stored["status"] == "in_progress" and stored["in_progress_at"] == 1_800_000_000
    assert stored["request_counts"] == {"total": 3, "completed": 0, "failed": 0} and started == repo.get(
        record.id
    )


def test_every_allowed_transition_stamps_its_time_once():
    for source, targets in ALLOWED.items():
        for target in targets:
            record = new_batch_record("file-abc", "/v1/completions", "24h", None)
            record.status = source
            transition(record, target, now=1_800_000_000)
            assert record.status == target and getattr(record, f"{target.value}_at") == 1_800_000_000


def test_an_illegal_transition_raises_and_leaves_the_record_as_it_was():
    record = new_batch_record("file-abc", "/v1/completions", "24h", None)
    before = record.to_json()
    with pytest.raises(IllegalTransition, match="validating -> completed"):
        transition(record, BatchStatus.COMPLETED)  # a batch never completes without running
    assert record.to_json() == before
    for ended in TERMINAL_STATUSES:  # an ended batch never moves again
        record.status = ended
        for status in BatchStatus:
            with pytest.raises(IllegalTransition):
                transition(record, status)
    record.status = BatchStatus.FINALIZING
    with pytest.raises(IllegalTransition):
        transition(record, BatchStatus.IN_PROGRESS)


def test_cancel_and_close_follow_the_table():
    record = new_batch_record("file-abc", "/v1/completions", "24h", None)
    assert lifecycle.cancel(record).status == "cancelling" and lifecycle.cancel(record) is None  # idempotent
    record = transition(new_batch_record("file-abc", "/v1/completions", "24h", None), "in_progress")
    closed = lifecycle.close(record, "batch_cancelled")  # stopped on its own: cancelling is stamped too
    assert closed.status == "cancelled" and closed.cancelling_at is not None
    with pytest.raises(Conflict, match="can no longer be cancelled"):
        lifecycle.cancel(_finalizing())
    assert lifecycle.begin_finalizing(closed) is None  # only from in_progress


def _finalizing() -> BatchRecord:
    record = transition(new_batch_record("file-abc", "/v1/completions", "24h", None), "in_progress")
    return lifecycle.begin_finalizing(record)
