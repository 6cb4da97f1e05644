"""Deleting a file while a batch is being created on it: exactly one of the two wins, by a conditional write.

The interleavings are forced with gates on a real LocalStore (tests/support/gated_store.py); a stress loop
then runs both at once through the real service and the openai client.
"""

from __future__ import annotations

import io
import json
import threading

import openai
import pytest

from bulkgen.batch.schema import Conflict, InvalidRequest
from bulkgen.batch.service import BatchService
from bulkgen.settings import Settings
from tests.support.gated_store import GatedStore
from tests.support.service import MODEL, chat_row, wait_done

ROWS = b"".join(json.dumps(chat_row(f"r{i}", f"hello {i}", max_tokens=2)).encode() + b"\n" for i in range(2))


@pytest.fixture
def gated(tmp_path):
    (tmp_path / "store").mkdir()
    store = GatedStore(tmp_path / "store", fsync=False)
    svc = BatchService(Settings(storage=store.url, models={MODEL: "unused"}), store=store)
    return store, svc, svc.files.create(io.BytesIO(ROWS), "in.jsonl", "batch")["id"]


def _in_thread(fn) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(fn())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def _create(svc: BatchService, file_id: str):
    return lambda: svc.create_batch(file_id, "/v1/chat/completions", "24h", None)


def test_a_delete_while_the_batch_is_being_created_is_refused(gated):
    store, svc, file_id = gated
    gate = store.gate("write", r"files/use/.*")  # the creator has written its ref, not yet its claim
    creator, created = _in_thread(_create(svc, file_id))
    gate.wait_reached()
    with pytest.raises(Conflict, match="which is being created") as err:
        svc.delete_file(file_id)
    assert err.value.code == "file_in_use"
    gate.open()
    creator.join(30)
    assert created[0].status == "validating" and svc.files.get(file_id)["id"] == file_id


def test_a_create_that_claims_first_wins_over_a_delete_that_checked_before(gated):
    store, svc, file_id = gated
    gate = store.gate("write", r"files/use/.*")  # the deleter found no batch, and is about to mark the file
    deleter, deleted = _in_thread(lambda: svc.delete_file(file_id))
    gate.wait_reached()
    record = _create(svc, file_id)()  # lands its claim first
    gate.open()
    deleter.join(30)
    assert isinstance(deleted[0], Conflict) and record.id in str(deleted[0])
    assert svc.files.get(file_id)["id"] == file_id and svc.batches.get(record.id).status == "validating"


def test_a_create_after_the_delete_claimed_the_file_is_refused(gated):
    store, svc, file_id = gated
    gate = store.gate("delete", r"files/meta/.*")  # the deleter has marked the file, not yet removed it
    deleter, deleted = _in_thread(lambda: svc.delete_file(file_id))
    gate.wait_reached()
    with pytest.raises(InvalidRequest, match="is being deleted"):
        _create(svc, file_id)()
    gate.open()
    deleter.join(30)
    assert deleted == [None]
    assert list(store.list("files/")) == [] and list(store.list("batches/")) == []  # no ref, no batch left


def test_create_and_delete_at_once_never_both_succeed(service, client):
    rounds, created = 15, []
    for n in range(rounds):
        file_id = client.files.create(file=(f"race{n}.jsonl", ROWS), purpose="batch").id
        start = threading.Barrier(2)

        def create(file_id=file_id, start=start):
            start.wait()
            return client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )

        def delete(file_id=file_id, start=start):
            start.wait()
            return client.files.delete(file_id)

        (c, batch), (d, gone) = _in_thread(create), _in_thread(delete)
        c.join(60)
        d.join(60)
        won_create, won_delete = not isinstance(batch[0], Exception), not isinstance(gone[0], Exception)
        assert won_create != won_delete, (n, batch, gone)  # exactly one wins
        if won_create:
            assert isinstance(gone[0], openai.ConflictError) and gone[0].body["code"] == "file_in_use"
            created.append(batch[0].id)
        else:
            assert isinstance(batch[0], openai.BadRequestError) and batch[0].body["code"] == "invalid_file"
    for batch_id in created:
        done = wait_done(client, batch_id, timeout=180)
        assert done.status == "completed", (batch_id, done.errors)
