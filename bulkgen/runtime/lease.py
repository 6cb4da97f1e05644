"""A runner's claim on a batch: a conditional write with an expiry, renewed while the runner lives.

`leases/<batch_id>.json` = {owner, expires_at}. Taking it is a create-if-absent, or a replace-if-
unchanged of a lease whose time ran out; renewing is a replace-if-unchanged of our own. So of two
service replicas on one storage URL exactly one runs a batch, and when its process dies the other
takes over once the lease lapses (after at most `ttl_s`).
"""

from __future__ import annotations

import json
import time

from bulkgen.store import NotFound, PreconditionFailed, Store


class LeaseLost(Exception):
    """Another owner holds the batch now: stop working on it, and never finalize it."""


class Lease:
    def __init__(self, store: Store, batch_id: str, owner: str, ttl_s: float) -> None:
        self.store, self.batch_id, self.owner, self.ttl_s = store, batch_id, owner, ttl_s
        self.key = f"leases/{batch_id}.json"
        self._version: str | None = None

    def acquire(self) -> bool:
        """Take the lease if it is free, lapsed, or already ours; False if another owner holds it."""
        try:
            data, version = self.store.read_versioned(self.key)
        except NotFound:
            return self._write(if_none_match=True)
        current = json.loads(data)
        if current["owner"] != self.owner and current["expires_at"] > time.time():
            return False
        self._version = version
        return self._write(if_match=version)

    def renew(self) -> None:
        """Extend our lease; LeaseLost if someone took it meanwhile (we were presumed dead)."""
        if self._version is None or not self._write(if_match=self._version):
            raise LeaseLost(f"lease on {self.batch_id} was taken by another runner")

    def release(self) -> None:
        """Give the lease up (the batch ended): delete it only while it is still ours."""
        try:
            data, _ = self.store.read_versioned(self.key)
        except NotFound:
            return
        if json.loads(data)["owner"] == self.owner:
            self.store.delete(self.key)
        self._version = None

    def _write(self, *, if_match: str | None = None, if_none_match: bool = False) -> bool:
        body = json.dumps({"owner": self.owner, "expires_at": time.time() + self.ttl_s}).encode()
        try:
            self._version = self.store.write_bytes(self.key, body, if_match=if_match, if_none_match=if_none_match)
            return True
        except PreconditionFailed:
            self._version = None
            return False
