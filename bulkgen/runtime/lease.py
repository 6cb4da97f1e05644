"""A runner's claim on a batch: a TTL lease (bulkgen.store.conditional) on the batch's lease key.

The lease (`layout.lease`) = {owner, expires_at}. Taking it is a create-if-absent, or a replace-if-
unchanged of a lease whose time ran out; renewing is a replace-if-unchanged of our own. So of two
service replicas on one storage URL exactly one runs a batch, and when its process dies the other
takes over once the lease lapses (after at most `ttl_s`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bulkgen.store import Store, layout
from bulkgen.store.conditional import TtlLease


class LeaseLost(Exception):
    """Another owner holds the batch now: stop working on it, and never finalize it."""


class Lease(TtlLease):
    def __init__(self, store: Store, batch_id: str, owner: str, ttl_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(store, layout.lease(batch_id), owner, ttl_s, clock)
        self.batch_id = batch_id

    def acquire(self) -> bool:
        """Take the lease if it is free, lapsed, or already ours; False if another owner holds it."""
        return self.take()

    def renew(self) -> None:
        """Extend our lease; LeaseLost if someone took it meanwhile (we were presumed dead)."""
        if not super().renew():
            raise LeaseLost(f"lease on {self.batch_id} was taken by another runner")
