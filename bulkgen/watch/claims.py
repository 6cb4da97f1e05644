"""Claims: each input object version (input URL + key + ETag) is processed once, by one watcher.

In the service storage, beside the batches the claims lead to (keys: bulkgen.store.layout):

  a claim       {owner, expires_at, state, batch_id, file_id, input, key, etag}
  a done mark   empty: the object version is finished (results or a report written)

A claim is a TTL lease (bulkgen.store.conditional). Taking it is a create-if-absent; a claim whose owner
stopped renewing it (its process died) is retaken with a replace-if-unchanged once `expires_at` has
passed, and the new owner carries on from what the claim records: the batch it started (resumed, never
created twice) or the input file it uploaded. Finished object versions are found with one listing of the
done marks, so a poll costs a few listings and no request per old object. A changed object has a new ETag,
hence a new claim: it is processed again.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from bulkgen.batch.ids import new_id
from bulkgen.store import ObjectInfo, Store, layout
from bulkgen.store.conditional import TtlLease


class ClaimLost(Exception):
    """Another watcher took the claim over (this one was presumed dead): leave the object to it."""


@dataclass
class Claim:
    name: str
    info: ObjectInfo
    lease: TtlLease
    renewed_at: float  # on the Claims' timer

    @property
    def body(self) -> dict:
        return self.lease.body

    @property
    def retaken(self) -> bool:
        """An earlier owner held it: carry on from what it recorded."""
        return self.lease.retaken

    @property
    def batch_id(self) -> str | None:
        return self.body.get("batch_id")

    @property
    def file_id(self) -> str:
        return self.body["file_id"]


class Claims:
    """`clock` (wall seconds) stamps and checks the claims' `expires_at`; `timer` (monotonic seconds) says
    when this watcher's own claims are due for renewal. Tests pass fake ones to lapse a claim at once."""

    def __init__(
        self,
        store: Store,
        input_url: str,
        owner: str,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.input_url, self.owner, self.ttl_s = store, input_url, owner, ttl_s
        self.clock, self.timer = clock, timer

    def name(self, info: ObjectInfo) -> str:
        return hashlib.sha256(f"{self.input_url}\n{info.key}\n{info.etag}".encode()).hexdigest()[:40]

    def done_names(self) -> set[str]:
        """Every finished object version (one paginated listing)."""
        return {layout.watch_done_name(key) for key in self.store.list(layout.WATCH_DONE)}

    def take(self, info: ObjectInfo) -> Claim | None:
        """The claim on this object version, or None when it is finished or another live watcher holds it."""
        name = self.name(info)
        lease = TtlLease(self.store, layout.watch_claim(name), self.owner, self.ttl_s, self.clock)
        body = {
            "state": "claimed",
            "batch_id": None,
            "file_id": new_id("file-"),
            "input": self.input_url,
            "key": info.key,
            "etag": info.etag,
        }
        if not lease.take(body, create_first=True, unless=lambda current: self._finished(name, current)):
            return None
        return Claim(name, info, lease, self.timer())

    def _finished(self, name: str, current: dict) -> bool:
        """A claim marked done whose done mark was never written (its owner died between): write it now."""
        if current["state"] != "done":
            return False
        self.store.write_bytes(layout.watch_done(name), b"")
        return True

    def update(self, claim: Claim, **changes) -> None:
        """Record progress (and renew): ClaimLost if another watcher has taken the claim meanwhile."""
        if not claim.lease.renew(**changes):
            raise ClaimLost(f"claim on {claim.info.key} was taken over by another watcher")
        claim.renewed_at = self.timer()

    def renew_due(self, claim: Claim) -> bool:
        return self.timer() - claim.renewed_at >= self.ttl_s / 3

    def finish(self, claim: Claim, **changes) -> None:
        """The object version is done: mark the claim, then the done index the polls read."""
        self.update(claim, state="done", **changes)
        self.store.write_bytes(layout.watch_done(claim.name), b"")
