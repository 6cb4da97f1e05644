"""Who reads a file, and the one conditional write that orders "create a batch on it" against "delete it".

In the tenant's storage, beside the file's record (keys: bulkgen.store.layout):

  a ref per batch           {"created_at": ...}: this batch reads the file (written before its record)
  the file's use object     {"pins": n, "deleting": bool}: bumped by every batch created on the file,
                            set to deleting by the delete that wins

A creator writes its ref, then bumps the use object with a replace-if-unchanged; a deleter checks the
refs, then sets `deleting` with a replace-if-unchanged of the version it read before that check. Whichever
write lands first wins: a creator that lands first has its ref stored before the deleter looks (the
deleter's write then fails, it looks again and answers 409); a deleter that lands first makes the creator's
write fail, and the creator finds `deleting` and refuses. Timing never decides, and never both.

A ref without a batch record is a creation under way (its creator is between writes): it keeps the file
in use for REF_GRACE_S, after which it is a leftover of a creator that died, and ignored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from bulkgen.batch.records import FileRepo
from bulkgen.store import NotFound, Store, layout
from bulkgen.store.conditional import update_json

REF_GRACE_S = 600.0
_ATTEMPTS = 50


class FileDeleting(Exception):
    """The file is being deleted: no batch may start reading it."""


def ref_prefix(file_id: str) -> str:
    return layout.file_refs(FileRepo.check(file_id))


def ref_key(file_id: str, batch_id: str) -> str:
    return layout.file_ref(FileRepo.check(file_id), batch_id)


def ref_age(store: Store, key: str, now: float | None = None) -> float:
    """Seconds since the ref was written (a ref gone or without a time counts as old)."""
    try:
        written = float(json.loads(store.read_bytes(key))["created_at"])
    except (NotFound, ValueError, KeyError, TypeError):
        return float("inf")
    return (time.time() if now is None else now) - written


def pin(store: Store, file_id: str, batch_id: str) -> None:
    """Record that `batch_id` reads the file: the ref, then the bump that orders it before any delete.
    FileDeleting (and no ref left behind) if a delete won."""
    store.write_bytes(ref_key(file_id, batch_id), json.dumps({"created_at": time.time()}).encode())
    try:
        _change(store, file_id, _bump)
    except FileDeleting:
        store.delete(ref_key(file_id, batch_id))
        raise


def unpin(store: Store, file_id: str, batch_id: str) -> None:
    """A batch whose creation failed after `pin` no longer reads the file."""
    store.delete(ref_key(file_id, batch_id))


def begin_delete(store: Store, file_id: str, check_refs: Callable[[], None]) -> None:
    """Mark the file `deleting`; `check_refs()` raises (Conflict) while a batch still reads it. It runs
    again whenever a creator's bump landed in between, so it always sees every ref of a winning creator."""

    def mark(state: dict) -> dict:
        check_refs()
        return {**state, "deleting": True}

    _change(store, file_id, mark, refuse_deleting=False)


def end_delete(store: Store, file_id: str) -> None:
    """The file and its refs are gone: drop its use object last (a creator that reads none re-checks
    that the file still exists after its bump)."""
    store.delete_prefix(ref_prefix(file_id))
    store.delete(layout.file_use(FileRepo.check(file_id)))


def _bump(state: dict) -> dict:
    return {**state, "pins": state.get("pins", 0) + 1}


def _change(store: Store, file_id: str, change: Callable[[dict], dict], refuse_deleting: bool = True) -> None:
    """A write lost to another creator or a deleter looks again (update_json)."""

    def checked(state: dict) -> dict:
        if refuse_deleting and state.get("deleting"):
            raise FileDeleting(file_id)
        return change(state)

    key = layout.file_use(FileRepo.check(file_id))
    update_json(
        store,
        key,
        checked,
        missing={"pins": 0, "deleting": False},
        attempts=_ATTEMPTS,
        conflict=f"file {file_id}: too many concurrent batch creations and deletes",
    )
