"""A runner's claim on a batch: a TTL lease (bulkgen.store.conditional) on the batch's lease key.

The lease (`layout.lease`) = {owner, expires_at}. Taking it is a create-if-absent, or a replace-if-
unchanged of a lease whose time ran out; renewing is a replace-if-unchanged of our own. So of two
service replicas on one storage URL exactly one runs a batch, and when its process dies the other
takes over once the lease lapses (after at most `ttl_s`).

A batch taken over from another owner may still get parts from that owner's workers: when a head dies,
the engine actors on the other nodes outlive it (their raylets wait up to 60 s for the GCS) and store
the ranges they hold. Those stop storing once their driver has been silent for ORPHAN_AFTER_S
(bulkgen.runtime.part_writer), so the new runner finalizes only after `orphans_done_at()`: nothing of
theirs lands after the merge or is left behind by it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bulkgen.runtime.part_writer import ORPHAN_AFTER_S
from bulkgen.store import Store, layout
from bulkgen.store.conditional import TtlLease

PART_WRITE_S = 10.0  # a part write an orphan began before it noticed its driver was gone ends within this


class LeaseLost(Exception):
    """Another owner holds the batch now: stop working on it, and never finalize it."""


class Lease(TtlLease):
    def __init__(
        self,
        store: Store,
        batch_id: str,
        owner: str,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`clock` and `sleep` are time.time and time.sleep; a test passes a fake clock and its advance."""
        super().__init__(store, layout.lease(batch_id), owner, ttl_s, clock)
        self.sleep = sleep
        self.batch_id = batch_id
        self.taken_from: dict | None = None  # the lapsed lease of another owner we took the batch from

    def acquire(self) -> bool:
        """Take the lease if it is free, lapsed, or already ours; False if another owner holds it."""
        seen: dict = {}
        taken = self.take(unless=lambda current: seen.update(current) or False)
        self.taken_from = seen if taken and seen.get("owner", self.owner) != self.owner else None
        return taken

    def orphans_done_at(self) -> float:
        """When (time.time()) the workers of the owner we took over from can store no more parts: its
        last poll came before its lease lapsed, and they stop ORPHAN_AFTER_S after it. 0 if none."""
        if self.taken_from is None:
            return 0.0
        return float(self.taken_from["expires_at"]) + ORPHAN_AFTER_S + PART_WRITE_S

    def wait_for_orphans(self, stopped) -> None:
        """Block until `orphans_done_at()`; `stopped()` is checked each second (it raises to give up)."""
        while (left := self.orphans_done_at() - self.clock()) > 0:
            stopped()
            self.sleep(min(1.0, left))

    def renew(self) -> None:
        """Extend our lease; LeaseLost if someone took it meanwhile (we were presumed dead)."""
        if not super().renew():
            raise LeaseLost(f"lease on {self.batch_id} was taken by another runner")
