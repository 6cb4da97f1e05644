"""Claims: each input object version (input URL + key + ETag) is processed once, by one watcher.

In the service storage, beside the batches the claims lead to:

  watch/claims/<h>.json   {owner, expires_at, state, batch_id, file_id, input, key, etag}
  watch/done/<h>          empty: the object version is finished (results or a report written)

Taking a claim is a create-if-absent; a claim whose owner stopped renewing it (its process died) is
retaken with a replace-if-unchanged once `expires_at` has passed, and the new owner carries on from what
the claim records: the batch it started (resumed, never created twice) or the input file it uploaded.
Finished object versions are found with one listing of watch/done/, so a poll costs a few listings and
no request per old object. A changed object has a new ETag, hence a new claim: it is processed again.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

from bulkgen.batch.ids import new_id
from bulkgen.store import NotFound, ObjectInfo, PreconditionFailed, Store

CLAIMS = "watch/claims/"
DONE = "watch/done/"


class ClaimLost(Exception):
    """Another watcher took the claim over (this one was presumed dead): leave the object to it."""


@dataclass
class Claim:
    name: str
    info: ObjectInfo
    body: dict
    version: str
    retaken: bool = False
    renewed_at: float = field(default_factory=time.monotonic)

    @property
    def batch_id(self) -> str | None:
        return self.body.get("batch_id")

    @property
    def file_id(self) -> str:
        return self.body["file_id"]


class Claims:
    def __init__(self, store: Store, input_url: str, owner: str, ttl_s: float) -> None:
        self.store, self.input_url, self.owner, self.ttl_s = store, input_url, owner, ttl_s

    def name(self, info: ObjectInfo) -> str:
        return hashlib.sha256(f"{self.input_url}\n{info.key}\n{info.etag}".encode()).hexdigest()[:40]

    def done_names(self) -> set[str]:
        """Every finished object version (one paginated listing)."""
        return {key.removeprefix(DONE) for key in self.store.list(DONE)}

    def take(self, info: ObjectInfo) -> Claim | None:
        """The claim on this object version, or None when it is finished or another live watcher holds it."""
        name = self.name(info)
        body = {"owner": self.owner, "expires_at": time.time() + self.ttl_s, "state": "claimed", "batch_id": None,
                "file_id": new_id("file-"), "input": self.input_url, "key": info.key, "etag": info.etag}
        try:
            version = self.store.write_bytes(_key(name), _dumps(body), if_none_match=True)
            return Claim(name, info, body, version)
        except PreconditionFailed:
            pass
        try:
            data, version = self.store.read_versioned(_key(name))
        except NotFound:  # deleted between our write and read: the next poll takes it
            return None
        current = json.loads(data)
        if current["state"] == "done":  # finished, but its done mark was never written: write it now
            self.store.write_bytes(DONE + name, b"")
            return None
        if (current["owner"] != self.owner and current["expires_at"] > time.time()):
            return None
        current.update(owner=self.owner, expires_at=time.time() + self.ttl_s)
        try:
            version = self.store.write_bytes(_key(name), _dumps(current), if_match=version)
        except PreconditionFailed:  # another watcher retook it first
            return None
        return Claim(name, info, current, version, retaken=True)

    def update(self, claim: Claim, **changes) -> None:
        """Record progress (and renew): ClaimLost if another watcher has taken the claim meanwhile."""
        body = {**claim.body, **changes, "expires_at": time.time() + self.ttl_s}
        try:
            claim.version = self.store.write_bytes(_key(claim.name), _dumps(body), if_match=claim.version)
        except PreconditionFailed:
            raise ClaimLost(f"claim on {claim.info.key} was taken over by another watcher") from None
        claim.body, claim.renewed_at = body, time.monotonic()

    def renew_due(self, claim: Claim) -> bool:
        return time.monotonic() - claim.renewed_at >= self.ttl_s / 3

    def finish(self, claim: Claim, **changes) -> None:
        """The object version is done: mark the claim, then the done index the polls read."""
        self.update(claim, state="done", **changes)
        self.store.write_bytes(DONE + claim.name, b"")


def _key(name: str) -> str:
    return f"{CLAIMS}{name}.json"


def _dumps(body: dict) -> bytes:
    return json.dumps(body).encode()
