"""Service settings: plain data, validated once, read by every floor (batch, runtime, api, cli).

Nothing here does work; the batch service (`bulkgen.batch.service`) and the runtime take these values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from bulkgen.models.registry import parse_model_specs
from bulkgen.tenants import DEFAULT_TENANT, check_tenant

DEFAULT_STORAGE = os.path.join(".bulkgen", "storage")
SCHEDULING = ("fifo", "deadline")
BODY_TIMEOUT_S = 60.0  # seconds a request body may stall before the API refuses it (`serve --body-timeout`)


@dataclass
class WorkerSettings:
    """The engine worker actors: where Ray is, how many actors, and the engine's own settings."""

    ray_address: str | None = None       # None: start a local Ray; "auto", host:port or ray://…: join a cluster
    num_workers: int | None = None       # None: one per GPU in the cluster, else `cpu_workers`
    cpu_workers: int = 1
    cpu_threads: int | None = None       # torch threads per CPU worker (Ray sets 1 otherwise)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Settings:
    storage: str = DEFAULT_STORAGE          # a local folder, file:///…, or s3://bucket/prefix
    endpoint_url: str | None = None         # S3-compatible endpoint (else AWS_ENDPOINT_URL)
    models: dict[str, str] = field(default_factory=lambda: parse_model_specs([]))
    max_requests_per_batch: int = 50_000
    max_file_bytes: int = 200 * 1024 * 1024
    range_size: int = 32                    # requests per line range: the unit workers pull and parts hold
    scheduling: str = "fifo"                # order of batches: "fifo" (created_at) or "deadline" (expires_at)
    fair_share_after_s: float = 30.0        # a batch given no work for this long is served next (no starvation)
    lease_ttl_s: float = 30.0               # a runner's claim on a batch lapses this long after its last renewal
    storage_outage_timeout_s: float = 300.0  # a runner whose storage stays down this long stops (batch stays active)
    workers: WorkerSettings = field(default_factory=WorkerSettings)
    tenant: str = DEFAULT_TENANT            # whose batches `bulkgen run` / the watcher / a keyless service make
    refuse_infeasible: bool = False         # create answers 400 for a batch its window cannot hold (bulkgen.plan)

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        for name in ("range_size", "max_requests_per_batch", "max_file_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling must be one of {SCHEDULING}, got {self.scheduling!r}")
        if self.lease_ttl_s < 1:
            raise ValueError(f"lease_ttl_s must be at least 1 second, got {self.lease_ttl_s!r}")
        if not self.storage_outage_timeout_s > 0:
            raise ValueError(f"storage_outage_timeout_s must be > 0, got {self.storage_outage_timeout_s!r}")
        if self.fair_share_after_s < 0:
            raise ValueError(f"fair_share_after_s must be >= 0, got {self.fair_share_after_s!r}")
        if not self.models:
            raise ValueError("at least one model must be served")
