"""Service settings: plain data, validated once, read by every floor (batch, runtime, api, cli).

Nothing here does work; the batch service (`bulkgen.batch.service`) and the runtime take these values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from bulkgen.models.registry import parse_model_specs
from bulkgen.tenants import DEFAULT_TENANT, check_tenant, check_weight

DEFAULT_STORAGE = os.path.join(".bulkgen", "storage")
SCHEDULING = ("fifo", "deadline")
BODY_TIMEOUT_S = 60.0  # seconds a request body may stall before the API refuses it (`serve --body-timeout`)


def parse_tenant_weights(specs: tuple[str, ...] | list[str]) -> dict[str, float]:
    """`TENANT=W` flags (`--tenant-weight`) to tenant -> weight; ValueError naming the bad one."""
    weights = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            raise ValueError(f"--tenant-weight {spec[:80]!r}: expected TENANT=W, e.g. analytics=3")
        weights[check_tenant(name.strip())] = check_weight(value.strip(), f"tenant {name.strip()!r}")
    return weights


@dataclass
class WorkerSettings:
    """The engine worker actors: where Ray is, how many actors, and the engine's own settings."""

    ray_address: str | None = None       # None: start a local Ray; "auto", host:port or ray://…: join a cluster
    num_workers: int | None = None       # None: one per GPU in the cluster, else `cpu_workers`
    cpu_workers: int = 1
    cpu_threads: int | None = None       # torch threads per CPU worker (Ray sets 1 otherwise)
    poll_deadline_s: float = 30.0        # a worker that leaves a poll (answered within 0.5 s) unanswered this
                                         # long is presumed lost (node dead or cut off): its ranges go elsewhere
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
    tenant_weights: dict[str, float] = field(default_factory=dict)  # share of the workers; others weigh 1
    refuse_infeasible: bool = False         # create answers 400 for a batch its window cannot hold (bulkgen.plan)

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        for name, weight in self.tenant_weights.items():
            check_tenant(name)
            check_weight(str(weight), f"tenant {name!r}")
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
