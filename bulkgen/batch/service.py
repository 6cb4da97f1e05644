"""The batch service: storage, file and batch records, and the steps every door shares.

The API, `bulkgen run`, the watcher and the runtime all create, validate, cancel and close batches
through this one object, so a batch behaves the same whichever door it came in by. Besides the records
it keeps small indexes in storage (their keys: bulkgen.store.layout):

  the active index    one empty object per batch not yet ended, at the storage root for every tenant:
                      what runners scan
  file refs           a batch that reads a file: the file cannot be deleted while it runs (with the file's
                      use object, bulkgen.batch.fileuse: create vs delete)
  the totals          running totals of every ended batch, all tenants (bulkgen.batch.totals)

Each service object works for one tenant (bulkgen.tenants): its records, files, parts and leases live in
the tenant's folder, so another tenant's ids are simply not found there. `for_tenant` gives the service of
another tenant on the same storage.

Every write that publishes something comes after what it points to: a batch's ref and record before its
active entry, so a runner that finds an entry finds its record (see BatchManager for an entry that still
has none: a creator that died between the writes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

from bulkgen.batch import fileuse, lifecycle, totals
from bulkgen.batch.batchrecord import BatchRecord, new_batch_record
from bulkgen.batch.images import check_images
from bulkgen.batch.lifecycle import validate_batch
from bulkgen.batch.records import BatchRepo, FileRepo, RecordNotFound
from bulkgen.batch.requests import Fill
from bulkgen.batch.retry import retry_batch
from bulkgen.batch.schema import (
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    BatchStatus,
    Conflict,
    InvalidRequest,
    quote,
)
from bulkgen.batch.validate import ValidationResult, Validator
from bulkgen.models.loras import AdapterCatalog
from bulkgen.settings import Settings
from bulkgen.store import Store, layout, open_store
from bulkgen.tenants import DEFAULT_TENANT, tenant_prefix


class BatchService:
    def __init__(
        self,
        settings: Settings,
        store: Store | None = None,
        tenant: str | None = None,
        on_batch_end: Callable[[BatchRecord], None] | None = None,
        _family: dict | None = None,
        catalog: AdapterCatalog | None = None,
    ) -> None:
        """`store`: the storage root (default: settings.storage); `tenant`: default settings.tenant.
        `on_batch_end(record)`: called once per batch end (completed, failed, expired, cancelled), of any
        tenant, with the final record, by whichever door ended it here: validation at create, the runner,
        finalize. `catalog`: the served adapters (default: built from settings, which checks the `--lora`
        flags: AdapterError)."""
        self.settings = settings
        self.catalog = catalog or AdapterCatalog(
            settings.loras, settings.models, settings.lora_file, settings.endpoint_url
        )
        if store is None:  # opened here, at the start of a process: a local folder is made now, never later
            store = open_store(settings.storage, endpoint_url=settings.endpoint_url)
            store.create()
        self.root: Store = store
        self.tenant = tenant or settings.tenant
        prefix = tenant_prefix(self.tenant)
        self.store: Store = self.root.sub(prefix) if prefix else self.root
        self.files = FileRepo(self.store)
        self.batches = BatchRepo(self.store, on_end=on_batch_end)
        self._on_batch_end = on_batch_end
        self._family = _family if _family is not None else {}
        self._family.setdefault(self.tenant, self)

    def for_tenant(self, tenant: str) -> BatchService:
        """The service of `tenant` on the same storage (one object per tenant, shared)."""
        if tenant not in self._family:
            BatchService(
                self.settings,
                self.root,
                tenant,
                on_batch_end=self._on_batch_end,
                _family=self._family,
                catalog=self.catalog,
            )
        return self._family[tenant]

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        window: str,
        metadata: dict | None,
        output_expires_after_s: int | None = None,
        retry_of: str | None = None,
        batch_id: str | None = None,
    ) -> BatchRecord:
        """POST /v1/batches: check the input file and create the record in `validating`, in the active index;
        the runtime validates it (`validate`), so validation survives a restart like any other work.
        Writes in order: the file's ref (fileuse.pin: a delete of the file either wins before it, and this
        refuses, or answers 409), the record, then the active entry that makes runners look for it.
        `retry_of`, `batch_id`: a retry's original and the id its claim on the original chose
        (bulkgen.batch.retry)."""
        meta = self._input_file(input_file_id)
        record = new_batch_record(meta["id"], endpoint, window, metadata, batch_id=batch_id)
        record.retry_of = retry_of
        if output_expires_after_s:
            record.internal["output_expires_after_s"] = output_expires_after_s
        try:
            fileuse.pin(self.store, meta["id"], record.id)
        except fileuse.FileDeleting:
            raise _file_gone(input_file_id, "is being deleted") from None
        try:
            self._input_file(input_file_id)  # deleted before our pin (its use object already gone)
            self.batches.create(record)
        except BaseException:
            fileuse.unpin(self.store, meta["id"], record.id)
            raise
        self.root.write_bytes(self._active_key(record.id), b"")
        return record

    def _input_file(self, file_id: str) -> dict:
        try:
            meta = self.files.get(file_id)
        except RecordNotFound:
            raise _file_gone(file_id, "does not exist") from None
        if meta["purpose"] != "batch":
            raise InvalidRequest(
                f"file {meta['id']} has purpose {meta['purpose']!r}; batches need purpose 'batch'",
                param="input_file_id",
            )
        return meta

    def validator(self, endpoint: str | None, fill: Fill | None = None, found: bool = False) -> Validator:
        """The checks a batch of `endpoint` passes here (None: its first line's url): the served models,
        the request and embedding-input limits, the LoRA adapters this tenant may run and the tenant's
        images; `fill`, `found`: a watcher's job defaults and object (bulkgen.batch.validate.Validator)."""
        s = self.settings
        return Validator(
            endpoint,
            s.models,
            s.max_requests_per_batch,
            {name: adapter.base for name, adapter in self.catalog.adapters(self.tenant).items()},
            partial(check_images, store=self.store, policy=s.workers.images),
            fill,
            found,
            s.max_embedding_inputs_per_batch,
        )

    def validate(
        self,
        batch_id: str,
        on_request: Callable | None = None,
        amend: Callable[[BatchRecord], BatchRecord] | None = None,
        checked: ValidationResult | None = None,
    ) -> BatchRecord:
        """A batch in `validating` -> `in_progress` or `failed` (see lifecycle.validate_batch); `checked`:
        the result of the pass that stored its file."""
        record = validate_batch(
            self.files,
            self.batches,
            batch_id,
            self.validator,
            self.settings.max_file_bytes,
            on_request,
            amend,
            checked,
        )
        if record.status == BatchStatus.FAILED:
            self.mark_ended(batch_id, record)
        return record

    def retry(self, batch_id: str) -> BatchRecord:
        """A new batch of the ended batch's lines worth running again, linked both ways (bulkgen.batch.retry)."""
        return retry_batch(self, batch_id)

    def cancel(self, batch_id: str) -> BatchRecord:
        """Mark the batch `cancelling`; its runner (whichever replica holds it) finishes it. Idempotent."""
        return self.batches.update(batch_id, lifecycle.cancel)

    def active_batches(self) -> Iterator[tuple[str, str]]:
        """(tenant, batch id) of every batch not yet ended, of all tenants, oldest first (the index
        holds only those, so this stays cheap)."""
        found = []
        for key in self.root.list(layout.ACTIVE):
            tenant, batch_id = layout.active_entry(key)
            found.append((tenant or DEFAULT_TENANT, batch_id))
        return iter(sorted(found, key=lambda item: item[1], reverse=True))  # ids sort newest first

    def mark_ended(self, batch_id: str, record: BatchRecord | None = None) -> None:
        """The batch ended: add it to the running totals (once), then drop it from the active index."""
        record = record or self.batches.get(batch_id)
        if record.status in TERMINAL_STATUSES:
            totals.add_ended(self.root, record)
        self.root.delete(self._active_key(batch_id))

    def drop_from_index(self, batch_id: str) -> None:
        """An active entry whose record never came (its creator died between the two writes)."""
        self.root.delete(self._active_key(batch_id))

    def ensure_indexed(self, batch_id: str) -> None:
        """Put a batch still active back in the index (its creator may have died after the record)."""
        if self.batches.get(batch_id).status in ACTIVE_STATUSES:
            self.root.write_bytes(self._active_key(batch_id), b"")

    def _active_key(self, batch_id: str) -> str:
        return layout.active(BatchRepo.check(batch_id), "" if self.tenant == DEFAULT_TENANT else self.tenant)

    def delete_file(self, file_id: str) -> None:
        """Refuse (409) while a batch that reads the file has not ended (it would fail half way), or is
        being created on it; otherwise mark the file deleting (fileuse: the conditional write that a
        concurrent create_batch loses), then remove it."""
        self.files.get(file_id)
        fileuse.begin_delete(self.store, file_id, lambda: self._check_unused(file_id))
        self.files.delete(file_id)
        fileuse.end_delete(self.store, file_id)

    def _check_unused(self, file_id: str) -> None:
        for key in self.store.list(fileuse.ref_prefix(file_id)):
            batch_id = layout.ref_batch(key)
            try:
                status = self.batches.get(batch_id).status
            except RecordNotFound:  # its creator is between writes, or died (then the ref is old)
                status = (
                    "being created" if fileuse.ref_age(self.store, key) < fileuse.REF_GRACE_S else "deleted"
                )
            if status in ACTIVE_STATUSES or status == "being created":
                raise Conflict(
                    f"file {file_id} is the input of batch {batch_id}, which is {status}; delete the "
                    "file once the batch has ended (or cancel the batch first)",
                    param="file_id",
                    code="file_in_use",
                )


def _file_gone(file_id: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"input_file_id {quote(file_id)} {why}", param="input_file_id", code="invalid_file")
