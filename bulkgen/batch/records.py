"""File and batch records in object storage: the only state the service has.

Layout under the storage URL:
  files/meta/<file_id>.json   file object        files/data/<file_id>   its bytes
  batches/<batch_id>.json     batch object (conditional writes: two writers never overwrite each other)
Ids sort newest-first, so the default listing order is a plain key listing.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

from bulkgen.batch.ids import new_id
from bulkgen.batch.schema import TERMINAL_STATUSES, quote
from bulkgen.store import NotFound, PreconditionFailed, Store

log = logging.getLogger(__name__)
_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
FILE_PURPOSES = ("batch", "batch_output")


class RecordNotFound(LookupError):
    """No file or batch with that id (HTTP 404)."""


def _check_id(kind: str, object_id: str) -> str:
    """Ids are checked against their pattern before they name a storage key; a bad one is just not found."""
    if not isinstance(object_id, str) or not _ID.match(object_id):
        raise RecordNotFound(f"No such {kind}: {quote(object_id)}")
    return object_id


def _page(keys: Iterator[str], limit: int, keep: Callable[[dict], bool], load: Callable[[str], dict | None]):
    """Take `limit` records that pass `keep`; has_more says whether one more exists."""
    items: list[dict] = []
    for key in keys:
        record = load(key)
        if record is None or not keep(record):
            continue
        if len(items) == limit:
            return items, True
        items.append(record)
    return items, False


class FileRepo:
    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def meta_key(file_id: str) -> str:
        return f"files/meta/{_check_id('file', file_id)}.json"

    @staticmethod
    def data_key(file_id: str) -> str:
        return f"files/data/{_check_id('file', file_id)}"

    def create(self, fileobj: BinaryIO, filename: str, purpose: str, expires_after_s: int | None = None) -> dict:
        """Store the bytes first, then the record: a record never points at missing content."""
        return self.put(new_id("file-"), fileobj, filename, purpose, expires_after_s)

    def upload_data(self, fileobj: BinaryIO) -> tuple[str, int]:
        """Store the bytes of a new file (its record comes with write_meta) -> (file id, size)."""
        file_id = new_id("file-")
        return file_id, self.store.upload_fileobj(self.data_key(file_id), fileobj)

    def discard_data(self, file_id: str) -> None:
        self.store.delete(self.data_key(file_id))

    def put(self, file_id: str, fileobj: BinaryIO, filename: str, purpose: str,
            expires_after_s: int | None = None) -> dict:
        """Write (or rewrite, with the same id) a file: how a retried finalize leaves no orphans."""
        size = self.store.upload_fileobj(self.data_key(file_id), fileobj)
        return self.write_meta(file_id, size, filename, purpose, expires_after_s)

    def write_meta(self, file_id: str, size: int, filename: str, purpose: str,
                   expires_after_s: int | None = None) -> dict:
        """The file object of bytes already stored under data_key(file_id) (an upload streamed there)."""
        now = int(time.time())
        record = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": now,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": now + expires_after_s if expires_after_s else None,
            "status_details": None,
        }
        self.store.write_bytes(self.meta_key(file_id), json.dumps(record).encode())
        return record

    def get(self, file_id: str) -> dict:
        try:
            return json.loads(self.store.read_bytes(self.meta_key(file_id)))
        except NotFound:
            raise RecordNotFound(f"No such file: {file_id!r}") from None

    def list(self, after: str | None, limit: int, order: str = "desc", purpose: str | None = None):
        keys = self.store.list("files/meta/")
        if order == "asc":
            keys = reversed(list(keys))
        keys = _skip_through(keys, self.meta_key(after) if after else None)
        return _page(keys, limit, lambda r: purpose is None or r["purpose"] == purpose, lambda key: _load_json(self.store, key))

    def open(self, file_id: str) -> BinaryIO:
        self.get(file_id)
        return self.store.open_read(self.data_key(file_id))

    def iter_lines(self, file_id: str) -> Iterator[bytes]:
        return self.store.iter_lines(self.data_key(file_id))

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        self.store.delete(self.data_key(file_id))
        self.store.delete(self.meta_key(file_id))


def _load_json(store: Store, key: str) -> dict | None:
    try:
        return json.loads(store.read_bytes(key))
    except NotFound:  # deleted between listing and reading
        return None


def _skip_through(keys, marker: str | None):
    """Yield the keys after `marker` (the SDK's `after` cursor) in the given order."""
    seen = marker is None
    for key in keys:
        if seen:
            yield key
        elif key == marker:
            seen = True


class BatchRepo:
    def __init__(self, store: Store, on_end: Callable[[dict], None] | None = None) -> None:
        """`on_end(record)` runs once per batch end, after the write that moved the record into a final
        status (the conditional write makes that writer the only one)."""
        self.store = store
        self.on_end = on_end

    @staticmethod
    def key(batch_id: str) -> str:
        return f"batches/{_check_id('batch', batch_id)}.json"

    def create(self, record: dict) -> dict:
        self.store.write_bytes(self.key(record["id"]), json.dumps(record).encode(), if_none_match=True)
        return record

    def get(self, batch_id: str) -> dict:
        return self._get_versioned(batch_id)[0]

    def _get_versioned(self, batch_id: str) -> tuple[dict, str]:
        try:
            data, version = self.store.read_versioned(self.key(batch_id))
        except NotFound:
            raise RecordNotFound(f"No such batch: {batch_id!r}") from None
        return json.loads(data), version

    def update(self, batch_id: str, change: Callable[[dict], dict | None], attempts: int = 20) -> dict:
        """Read-modify-write with a conditional put; `change` may return None to leave the record as is."""
        for _ in range(attempts):
            record, version = self._get_versioned(batch_id)
            new = change(json.loads(json.dumps(record)))
            if new is None or new == record:
                return record
            try:
                self.store.write_bytes(self.key(batch_id), json.dumps(new).encode(), if_match=version)
            except PreconditionFailed:
                time.sleep(0.01)
                continue
            if self.on_end and new["status"] in TERMINAL_STATUSES and record["status"] not in TERMINAL_STATUSES:
                self._ended(new)
            return new
        raise RuntimeError(f"batch {batch_id}: too many concurrent updates")

    def _ended(self, record: dict) -> None:
        try:
            self.on_end(record)
        except Exception:  # a hook never undoes or fails the batch's ending
            log.exception("batch %s: on_end hook failed", record["id"])

    def list(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        keys = _skip_through(self.store.list("batches/"), self.key(after) if after else None)
        return _page(keys, limit, lambda r: True, lambda key: _load_json(self.store, key))

    def ids(self) -> Iterator[str]:
        for key in self.store.list("batches/"):
            yield key.removeprefix("batches/").removesuffix(".json")
