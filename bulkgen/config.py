"""Service settings and the context every component shares (storage, records, served models)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from bulkgen.batch.lifecycle import validate_batch
from bulkgen.batch.records import BatchRepo, FileRepo, RecordNotFound
from bulkgen.batch.schema import InvalidRequest, new_batch_record
from bulkgen.models.registry import parse_model_specs
from bulkgen.runtime.pool import PoolConfig
from bulkgen.store import Store, open_store

DEFAULT_STORAGE = os.path.join(".bulkgen", "storage")


@dataclass
class Settings:
    storage: str = DEFAULT_STORAGE          # a local folder, file:///…, or s3://bucket/prefix
    endpoint_url: str | None = None         # S3-compatible endpoint (else AWS_ENDPOINT_URL)
    models: dict[str, str] = field(default_factory=lambda: parse_model_specs([]))
    max_requests_per_batch: int = 50_000
    max_file_bytes: int = 200 * 1024 * 1024
    chunk_size: int = 64                    # requests per result part (the unit of checkpointing)
    pool: PoolConfig = field(default_factory=PoolConfig)

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError("chunk_size must be at least 1")
        if self.max_requests_per_batch < 1:
            raise ValueError("max_requests_per_batch must be at least 1")
        if not self.models:
            raise ValueError("at least one model must be served")


class Context:
    """Opened storage, the repositories over it, and the batch steps that need the settings.

    Cheap to build and holds no other state; the API, `bulkgen run` and the runner all go through it,
    so a batch is created and validated the same way whichever door it came in by."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store: Store = open_store(settings.storage, endpoint_url=settings.endpoint_url)
        self.files = FileRepo(self.store)
        self.batches = BatchRepo(self.store)

    def create_batch(self, input_file_id: str, endpoint: str, window: str, metadata: dict | None) -> dict:
        """POST /v1/batches: check the input file, create the record, validate it at once."""
        try:
            meta = self.files.get(input_file_id)
        except RecordNotFound:
            raise InvalidRequest(f"input_file_id {input_file_id!r} does not exist", param="input_file_id",
                                 code="invalid_file") from None
        if meta["purpose"] != "batch":
            raise InvalidRequest(f"file {meta['id']} has purpose {meta['purpose']!r}; batches need purpose 'batch'",
                                 param="input_file_id")
        record = self.batches.create(new_batch_record(meta["id"], endpoint, window, metadata))
        return self.validate(record["id"])

    def validate(self, batch_id: str) -> dict:
        s = self.settings
        return validate_batch(self.files, self.batches, batch_id, s.models, s.max_requests_per_batch,
                              s.max_file_bytes)
