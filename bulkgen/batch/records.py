"""File and batch records in object storage: the only state the service has.

Their keys are named in bulkgen.store.layout: a file's object and bytes, a batch's object (conditional
writes: two writers never overwrite each other). Ids sort newest-first, so the default listing order is a
plain key listing, and a page is a listing that starts after the cursor's key: O(page) whatever is stored,
and right even when the cursor's own object was deleted meanwhile (a cursor is a position, not an object).
Files listed oldest first (order=asc) read the keys up to the cursor (keys only, no records; 1,000 per S3
request) and keep the last page of them: O(page) records and memory, O(position) key listing.

A file whose `expires_at` has passed is gone for every reader at once (404, left out of lists); `bulkgen
gc` removes its bytes later.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.ids import new_id
from bulkgen.batch.schema import TERMINAL_STATUSES, InvalidRequest, quote
from bulkgen.store import NotFound, Store, layout
from bulkgen.store.conditional import update_json

log = logging.getLogger(__name__)
ID_PATTERN = r"^[A-Za-z0-9_\-]{1,128}$"  # every file and batch id (the OpenAPI description says so too)
_ID = re.compile(ID_PATTERN)  # used with fullmatch: `$` alone lets a trailing newline through
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600  # the hosted API's bounds for expires_after[seconds]


class RecordNotFound(LookupError):
    """No file or batch with that id (HTTP 404)."""


def _check_id(kind: str, object_id: str) -> str:
    """Ids are checked against their pattern before they name a storage key; a bad one is just not found."""
    if not isinstance(object_id, str) or not _ID.fullmatch(object_id):
        raise RecordNotFound(f"No such {kind}: {quote(object_id)}")
    return object_id


def _cursor(kind: str, after: str | None, key: Callable[[str], str]) -> str | None:
    """The storage key a page starts after. A cursor is a position, so a well-formed id of an object
    since deleted is fine; one that no id could be is the caller's mistake (400 naming `after`), not an
    object that is missing."""
    if after is None:
        return None
    if not _ID.fullmatch(after):
        raise InvalidRequest(
            f"after must be the id of a {kind}, as the last page's last_id; got {quote(after, 64)}",
            param="after",
            code="invalid_cursor",
        )
    return key(after)


def check_expires_after(seconds: Any, anchor: Any, param: str = "expires_after") -> int | None:
    """`expires_after` (files) or `output_expires_after` (batches): both parts or neither (as OpenAI's
    spec requires them), anchor created_at, 1 hour to 30 days. A form sends seconds as text: ASCII digits
    only, as the API reads them (no spaces, no other scripts' digits)."""
    if seconds is None and anchor is None:
        return None
    if anchor != "created_at":
        raise InvalidRequest(
            f"{param}[anchor] must be 'created_at'; got {quote(anchor, 64)}", param=f"{param}[anchor]"
        )
    if isinstance(seconds, str) and re.fullmatch(r"-?[0-9]{1,12}", seconds):
        seconds = int(seconds)
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int)
        or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S
    ):
        raise InvalidRequest(
            f"{param}[seconds] must be a whole number of seconds from {MIN_EXPIRY_S} (1 hour) to "
            f"{MAX_EXPIRY_S} (30 days); got {repr(seconds)[:64]}",
            param=f"{param}[seconds]",
        )
    return seconds


def expired(record: dict, now: float | None = None) -> bool:
    at = record.get("expires_at")
    return at is not None and at <= (time.time() if now is None else now)


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
    def check(file_id: str) -> str:
        """The id, if it may name a key (RecordNotFound if not)."""
        return _check_id("file", file_id)

    @staticmethod
    def meta_key(file_id: str) -> str:
        return layout.file_meta(_check_id("file", file_id))

    @staticmethod
    def data_key(file_id: str) -> str:
        return layout.file_data(_check_id("file", file_id))

    def create(
        self, fileobj: BinaryIO, filename: str, purpose: str, expires_after_s: int | None = None
    ) -> dict:
        """Store the bytes first, then the record: a record never points at missing content."""
        return self.put(new_id("file-"), fileobj, filename, purpose, expires_after_s)

    def upload_data(self, fileobj: BinaryIO) -> tuple[str, int]:
        """Store the bytes of a new file (its record comes with write_meta) -> (file id, size)."""
        file_id = new_id("file-")
        return file_id, self.store.upload_fileobj(self.data_key(file_id), fileobj)

    def discard_data(self, file_id: str) -> None:
        self.store.delete(self.data_key(file_id))

    def put(
        self, file_id: str, fileobj: BinaryIO, filename: str, purpose: str, expires_after_s: int | None = None
    ) -> dict:
        """Write (or rewrite, with the same id) a file: how a retried finalize leaves no orphans."""
        size = self.store.upload_fileobj(self.data_key(file_id), fileobj)
        return self.write_meta(file_id, size, filename, purpose, expires_after_s)

    def write_meta(
        self, file_id: str, size: int, filename: str, purpose: str, expires_after_s: int | None = None
    ) -> dict:
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

    def get(self, file_id: str, *, include_expired: bool = False) -> dict:
        record = _load_json(self.store, self.meta_key(file_id))
        # An expired file is answered exactly as an id that never existed: when it expired is not news
        # to give whoever holds the id.
        if record is None or (expired(record) and not include_expired):
            raise RecordNotFound(f"No such file: {file_id!r}")
        return record

    def list(self, after: str | None, limit: int, order: str = "desc", purpose: str | None = None):
        marker = _cursor("file", after, self.meta_key)
        if order == "asc":
            keys = _before(lambda: self.store.list(layout.FILES_META), marker, limit + 1)
        else:
            keys = self.store.list(layout.FILES_META, start_after=marker)
        now = time.time()

        def keep(r: dict) -> bool:
            return (purpose is None or r["purpose"] == purpose) and not expired(r, now)

        return _page(keys, limit, keep, lambda key: _load_json(self.store, key))

    def open(self, file_id: str) -> BinaryIO:
        self.get(file_id)
        return self.store.open_read(self.data_key(file_id))

    def iter_lines(self, file_id: str) -> Iterator[bytes]:
        return self.store.iter_lines(self.data_key(file_id))

    def delete(self, file_id: str) -> None:
        """The record first, then the bytes: a listed file never points at missing content."""
        self.get(file_id)
        self.store.delete(self.meta_key(file_id))
        self.store.delete(self.data_key(file_id))


def _load_json(store: Store, key: str) -> dict | None:
    try:
        return json.loads(store.read_bytes(key))
    except NotFound:  # deleted between listing and reading
        return None


def _before(list_keys: Callable[[], Iterator[str]], marker: str | None, count: int) -> Iterator[str]:
    """Newest-first keys -> the keys just before `marker` (all keys without one), oldest first, `count`
    at a time: pages that skip expired or filtered records may need another window, which ends where
    the last one began (another pass over the keys before it)."""
    while True:
        window: deque[str] = deque(maxlen=count)
        for key in list_keys():
            if marker is not None and key >= marker:
                break
            window.append(key)
        yield from reversed(window)
        if len(window) < count:
            return
        marker = window[0]


class BatchRepo:
    def __init__(self, store: Store, on_end: Callable[[BatchRecord], None] | None = None) -> None:
        """`on_end(record)` runs once per batch end, after the write that moved the record into a final
        status (the conditional write makes that writer the only one)."""
        self.store = store
        self.on_end = on_end

    @staticmethod
    def check(batch_id: str) -> str:
        """The id, if it may name a key (RecordNotFound if not)."""
        return _check_id("batch", batch_id)

    @staticmethod
    def key(batch_id: str) -> str:
        return layout.batch(_check_id("batch", batch_id))

    def create(self, record: BatchRecord) -> BatchRecord:
        self.store.write_bytes(self.key(record.id), json.dumps(record.to_json()).encode(), if_none_match=True)
        return record

    def get(self, batch_id: str) -> BatchRecord:
        try:
            data, _ = self.store.read_versioned(self.key(batch_id))
        except NotFound:
            raise RecordNotFound(f"No such batch: {batch_id!r}") from None
        return BatchRecord.from_json(json.loads(data))

    def update(
        self, batch_id: str, change: Callable[[BatchRecord], BatchRecord | None], attempts: int = 20
    ) -> BatchRecord:
        """Read-modify-write with a conditional put; `change` may return None to leave the record as is."""

        def changed(stored: dict) -> dict | None:
            new = change(BatchRecord.from_json(json.loads(json.dumps(stored))))
            new_json = None if new is None else new.to_json()
            return None if new_json is None or new_json == stored else new_json

        try:
            record, new = update_json(
                self.store,
                self.key(batch_id),
                changed,
                attempts=attempts,
                pause_s=0.01,
                conflict=f"batch {batch_id}: too many concurrent updates",
            )
        except NotFound:
            raise RecordNotFound(f"No such batch: {batch_id!r}") from None
        if new is None:
            return BatchRecord.from_json(record)
        ended = BatchRecord.from_json(new)
        if self.on_end and ended.status in TERMINAL_STATUSES and record["status"] not in TERMINAL_STATUSES:
            self._ended(ended)
        return ended

    def _ended(self, record: BatchRecord) -> None:
        try:
            self.on_end(record)
        except Exception:  # a hook never undoes or fails the batch's ending
            log.exception("batch %s: on_end hook failed", record.id)

    def list(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        keys = self.store.list(layout.BATCHES, start_after=_cursor("batch", after, self.key))
        return _page(keys, limit, lambda r: True, lambda key: self._load(key))

    def _load(self, key: str) -> BatchRecord | None:
        data = _load_json(self.store, key)
        return None if data is None else BatchRecord.from_json(data)

    def ids(self) -> Iterator[str]:
        for key in self.store.list(layout.BATCHES):
            yield layout.batch_id_of(key)
