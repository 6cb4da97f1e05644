"""Service settings and the context every component shares (storage, records, served models)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from bulkgen.batch.records import BatchRepo, FileRepo
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
    """Opened storage plus the repositories over it; cheap to build, holds no other state."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store: Store = open_store(settings.storage, endpoint_url=settings.endpoint_url)
        self.files = FileRepo(self.store)
        self.batches = BatchRepo(self.store)
