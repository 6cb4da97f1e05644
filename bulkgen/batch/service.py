"""The batch service: storage, file and batch records, and the steps every door shares.

The API, `bulkgen run`, the watcher and the runtime all create, validate, cancel and close batches
through this one object, so a batch behaves the same whichever door it came in by. Besides the records
it keeps two small indexes in storage:

  active/<batch_id>             one empty object per batch not yet ended: what runners scan for work
  files/refs/<file_id>/<batch>  a batch that reads this file: the file cannot be deleted while it runs
  meta/active-indexed           the active index was built from older records (done once per storage)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from bulkgen.batch.lifecycle import validate_batch
from bulkgen.batch.records import BatchRepo, FileRepo, RecordNotFound
from bulkgen.batch.schema import (
    ACTIVE_STATUSES,
    Conflict,
    InvalidRequest,
    new_batch_record,
    quote,
    set_status,
)
from bulkgen.settings import Settings
from bulkgen.store import Store, open_store

ACTIVE_PREFIX = "active/"
INDEXED_MARK = "meta/active-indexed"


class BatchService:
    def __init__(self, settings: Settings, store: Store | None = None) -> None:
        self.settings = settings
        self.store: Store = store or open_store(settings.storage, endpoint_url=settings.endpoint_url)
        self.files = FileRepo(self.store)
        self.batches = BatchRepo(self.store)

    def create_batch(self, input_file_id: str, endpoint: str, window: str, metadata: dict | None) -> dict:
        """POST /v1/batches: check the input file and create the record in `validating`, in the active index;
        the runtime validates it (`validate`), so validation survives a restart like any other work."""
        try:
            meta = self.files.get(input_file_id)
        except RecordNotFound:
            raise InvalidRequest(f"input_file_id {quote(input_file_id)} does not exist", param="input_file_id",
                                 code="invalid_file") from None
        if meta["purpose"] != "batch":
            raise InvalidRequest(f"file {meta['id']} has purpose {meta['purpose']!r}; batches need purpose 'batch'",
                                 param="input_file_id")
        record = new_batch_record(meta["id"], endpoint, window, metadata)
        self.store.write_bytes(_ref_key(meta["id"], record["id"]), b"")
        self.store.write_bytes(ACTIVE_PREFIX + record["id"], b"")
        return self.batches.create(record)

    def validate(self, batch_id: str, on_request: Callable | None = None) -> dict:
        """A batch in `validating` -> `in_progress` or `failed` (see lifecycle.validate_batch)."""
        s = self.settings
        record = validate_batch(self.files, self.batches, batch_id, s.models, s.max_requests_per_batch,
                                s.max_file_bytes, on_request)
        if record["status"] == "failed":
            self.store.delete(ACTIVE_PREFIX + batch_id)
        return record

    def cancel(self, batch_id: str) -> dict:
        """Mark the batch `cancelling`; its runner (whichever replica holds it) finishes it. Idempotent."""
        return self.batches.update(batch_id, _cancel)

    def active_ids(self) -> Iterator[str]:
        """Batches not yet ended, oldest first (the index holds only those, so this stays cheap)."""
        ids = [key.removeprefix(ACTIVE_PREFIX) for key in self.store.list(ACTIVE_PREFIX)]
        return reversed(ids)  # ids sort newest first

    def mark_ended(self, batch_id: str) -> None:
        self.store.delete(ACTIVE_PREFIX + batch_id)

    def reindex_active(self) -> int:
        """Build the active index from the records, once per storage (written by an older version that
        had none); -> batches found active."""
        if self.store.exists(INDEXED_MARK):
            return 0
        found = 0
        for batch_id in self.batches.ids():
            if self.batches.get(batch_id)["status"] in ACTIVE_STATUSES:
                self.store.write_bytes(ACTIVE_PREFIX + batch_id, b"")
                found += 1
        self.store.write_bytes(INDEXED_MARK, b"")
        return found

    def delete_file(self, file_id: str) -> None:
        """Refuse (409) while a batch that reads the file has not ended: it would fail half way."""
        self.files.get(file_id)
        for key in self.store.list(f"files/refs/{file_id}/"):
            batch_id = key.rsplit("/", 1)[-1]
            try:
                status = self.batches.get(batch_id)["status"]
            except RecordNotFound:
                status = "deleted"
            if status in ACTIVE_STATUSES:
                raise Conflict(f"file {file_id} is the input of batch {batch_id}, which is {status}; delete the "
                               "file once the batch has ended (or cancel the batch first)",
                               param="file_id", code="file_in_use")
        self.files.delete(file_id)
        self.store.delete_prefix(f"files/refs/{file_id}/")


def _ref_key(file_id: str, batch_id: str) -> str:
    return f"files/refs/{FileRepo.data_key(file_id).rsplit('/', 1)[-1]}/{batch_id}"


def _cancel(record: dict) -> dict | None:
    if record["status"] in ("cancelling", "cancelled"):
        return None
    if record["status"] not in ("validating", "in_progress"):
        raise Conflict(f"batch {record['id']} is {record['status']} and can no longer be cancelled",
                       code="batch_not_cancellable")
    return set_status(record, "cancelling")
