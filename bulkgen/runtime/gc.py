"""`bulkgen gc`: remove what storage no longer needs, without touching anything a live batch reads.

  expired files     record, bytes and refs of files past `expires_at` (already 404 to readers); a
                    file that is still the input of an active batch is kept until it ends
  orphaned parts    parts of ended batches (a finalize that died before deleting them), and every part
                    of a batch whose record is gone
  stale leases      leases of batches that ended or are gone

Leases of active batches are never touched (a runner renews its own), whether lapsed or not.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from bulkgen.batch.records import FileRepo, RecordNotFound, expired
from bulkgen.batch.schema import ACTIVE_STATUSES
from bulkgen.batch.service import BatchService
from bulkgen.store import NotFound, layout
from bulkgen.tenants import DEFAULT_TENANT


@dataclass
class Collected:
    expired_files: list[str] = field(default_factory=list)
    kept_in_use: list[str] = field(default_factory=list)
    part_keys: list[str] = field(default_factory=list)
    part_batches: set[str] = field(default_factory=set)
    leases: list[str] = field(default_factory=list)

    def lines(self, dry_run: bool) -> list[str]:
        verb = "would remove" if dry_run else "removed"
        kept = f"; kept {len(self.kept_in_use)} still read by an active batch" if self.kept_in_use else ""
        return [
            f"expired files: {verb} {len(self.expired_files)}{_ids(self.expired_files)}{kept}",
            f"orphaned parts: {verb} {len(self.part_keys)} objects of {len(self.part_batches)} ended batches",
            f"stale leases: {verb} {len(self.leases)}{_ids(self.leases)}",
        ]


def _ids(ids: list[str], show: int = 5) -> str:
    if not ids:
        return ""
    more = f", … {len(ids) - show} more" if len(ids) > show else ""
    return f" ({', '.join(ids[:show])}{more})"


def collect(svc: BatchService, dry_run: bool = False, now: float | None = None) -> Collected:
    """Every tenant's objects on the storage (the default tenant's at its root, the others' under
    their own root, layout.tenant_root)."""
    now = time.time() if now is None else now
    found = Collected()
    for tenant in tenants(svc):
        one = svc.for_tenant(tenant)
        status_of = _StatusCache(one)
        _expired_files(one, found, status_of, now, dry_run)
        _orphaned_parts(one, found, status_of, dry_run)
        _stale_leases(one, found, status_of, dry_run)
    return found


def tenants(svc: BatchService) -> list[str]:
    names = layout.tenant_names(svc.root.list(layout.TENANTS))
    return [DEFAULT_TENANT, *sorted(names)]


class _StatusCache:
    def __init__(self, svc: BatchService) -> None:
        self.svc, self.seen = svc, {}

    def __call__(self, batch_id: str) -> str | None:
        """The batch's status, or None when its record is gone."""
        if batch_id not in self.seen:
            try:
                self.seen[batch_id] = self.svc.batches.get(batch_id).status
            except RecordNotFound:
                self.seen[batch_id] = None
        return self.seen[batch_id]


def _expired_files(svc: BatchService, found: Collected, status_of, now: float, dry_run: bool) -> None:
    store = svc.store
    for key in list(store.list(layout.FILES_META)):
        try:
            record = json.loads(store.read_bytes(key))
        except NotFound:
            continue
        if not expired(record, now):
            continue
        file_id = record["id"]
        refs = list(store.list(layout.file_refs(file_id)))
        if any(status_of(layout.ref_batch(ref)) in ACTIVE_STATUSES for ref in refs):
            found.kept_in_use.append(file_id)
            continue
        found.expired_files.append(file_id)
        if not dry_run:
            store.delete(FileRepo.data_key(file_id))
            store.delete(key)
            for ref in refs:
                store.delete(ref)


def _orphaned_parts(svc: BatchService, found: Collected, status_of, dry_run: bool) -> None:
    for key in list(svc.store.list(layout.PARTS)):
        batch_id = layout.parts_batch(key)
        status = status_of(batch_id)
        if status in ACTIVE_STATUSES:
            continue
        if status is not None and layout.is_runner_note(key):  # an ended batch keeps who ran it
            continue
        found.part_keys.append(key)
        found.part_batches.add(batch_id)
        if not dry_run:
            svc.store.delete(key)


def _stale_leases(svc: BatchService, found: Collected, status_of, dry_run: bool) -> None:
    for key in list(svc.store.list(layout.LEASES)):
        batch_id = layout.lease_batch(key)
        if status_of(batch_id) in ACTIVE_STATUSES:
            continue
        found.leases.append(batch_id)
        if not dry_run:
            svc.store.delete(key)
