"""The two ways bulkgen changes shared JSON objects safely: a read-modify-write, and a TTL lease.

Both rest on the store's conditional writes (create-if-absent, replace-if-unchanged), so two writers
never overwrite each other, on a local folder or on S3, without a lock service:

  update_json   read an object, change it, write it back only if nobody wrote in between (else again):
                batch records, the running totals, a file's use object
  TtlLease      {"owner", "expires_at", ...} on one key, renewed while its owner lives and taken over by
                another once it lapses: a runner's lease on a batch, a watcher's claim on an input object
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from bulkgen.store.base import NotFound, PreconditionFailed, Store


def update_json(
    store: Store,
    key: str,
    change: Callable[[dict], dict | None],
    *,
    missing: dict | None = None,
    attempts: int = 50,
    pause_s: float = 0.005,
    conflict: str | None = None,
) -> tuple[dict, dict | None]:
    """Apply `change` to the object at `key` with a conditional write, again whenever another writer landed
    first -> (the object before, the object written, or None when `change` wrote nothing). `change` gets
    the stored object (or a copy of `missing` when there is none; NotFound if `missing` is None) and
    returns the new one, or None to leave it as is. RuntimeError(`conflict`) after `attempts` lost writes."""
    for _ in range(attempts):
        try:
            data, version = store.read_versioned(key)
            state = json.loads(data)
        except NotFound:
            if missing is None:
                raise
            state, version = json.loads(json.dumps(missing)), None
        new = change(state)
        if new is None:
            return state, None
        try:
            store.write_bytes(key, json.dumps(new).encode(), if_match=version, if_none_match=version is None)
            return state, new
        except PreconditionFailed:  # another writer landed first: look again
            time.sleep(pause_s)
    raise RuntimeError(conflict or f"{key}: too many concurrent updates")


class TtlLease:
    """One owner's hold on a key: a JSON body {"owner", "expires_at", ...} written conditionally.

    Taking is a create-if-absent, or a replace-if-unchanged of a body that is ours or whose time ran out
    (its other fields carry on, so a new owner continues what the last one recorded); renewing is a
    replace-if-unchanged of our own version. So of two owners exactly one holds the key, and when one dies
    the other takes over once `expires_at` has passed (after at most `ttl_s`).

    `clock` gives the wall time in seconds (`expires_at` is compared across processes and machines);
    tests pass a fake one to make a lease lapse without waiting.
    """

    def __init__(
        self, store: Store, key: str, owner: str, ttl_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.store, self.key, self.owner, self.ttl_s, self.clock = store, key, owner, ttl_s, clock
        self.body: dict = {}
        self.version: str | None = None
        self.retaken = False

    def take(
        self,
        body: dict | None = None,
        *,
        create_first: bool = False,
        unless: Callable[[dict], bool] | None = None,
    ) -> bool:
        """Hold the key -> True (`retaken` when it held a body already), or False when another live owner
        holds it, `unless(stored body)` is true, or another taker won. A new key gets `body`.
        `create_first`: try the create before the read (fewer requests where most keys are new)."""
        self.retaken = False
        if create_first and self._put(body or {}, if_none_match=True):
            return True
        try:
            data, version = self.store.read_versioned(self.key)
        except NotFound:  # free (or, after a lost create, deleted since: a later take finds it)
            return not create_first and self._put(body or {}, if_none_match=True)
        current = json.loads(data)
        if (unless is not None and unless(current)) or (
            current["owner"] != self.owner and current["expires_at"] > self.clock()
        ):
            return False
        self.retaken = True
        return self._put(current, if_match=version)

    def renew(self, **changes) -> bool:
        """Extend our hold, recording `changes` in the body; False when another owner took the key."""
        return self.version is not None and self._put({**self.body, **changes}, if_match=self.version)

    def release(self) -> None:
        """Give the key up: delete it only while it is still ours."""
        try:
            data, _ = self.store.read_versioned(self.key)
        except NotFound:
            return
        if json.loads(data)["owner"] == self.owner:
            self.store.delete(self.key)
        self.version = None

    def _put(self, body: dict, *, if_match: str | None = None, if_none_match: bool = False) -> bool:
        body = {**body, "owner": self.owner, "expires_at": self.clock() + self.ttl_s}
        try:
            self.version = self.store.write_bytes(
                self.key, json.dumps(body).encode(), if_match=if_match, if_none_match=if_none_match
            )
        except PreconditionFailed:
            self.version = None
            return False
        self.body = body
        return True
