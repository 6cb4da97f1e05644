"""Prometheus metrics for the service, derived from the batch records (the system of record)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bulkgen.batch.schema import ACTIVE_STATUSES


class RecordCache:
    """Batch records, re-listed at most every few seconds however often Prometheus scrapes."""

    def __init__(self, svc, max_age_s: float = 5.0) -> None:
        self.svc, self.max_age_s = svc, max_age_s
        self.at, self.records = float("-inf"), []

    def get(self) -> list[dict]:
        if time.monotonic() - self.at > self.max_age_s:
            self.records = list(self._iter())
            self.at = time.monotonic()
        return self.records

    def _iter(self):
        for batch_id in self.svc.batches.ids():
            try:
                yield self.svc.batches.get(batch_id)
            except LookupError:  # deleted between listing and reading
                continue


def render_metrics(cache: RecordCache, manager) -> tuple[bytes, str]:
    registry = CollectorRegistry()
    batches = Gauge("bulkgen_batches", "Batches by status", ["status"], registry=registry)
    requests = Gauge("bulkgen_requests", "Requests by outcome, over all stored batches", ["outcome"], registry=registry)
    tokens = Gauge("bulkgen_tokens", "Tokens processed, over all stored batches", ["kind"], registry=registry)
    queued = Gauge("bulkgen_queue_batches", "Batches waiting for the worker pool", registry=registry)
    pending = Gauge("bulkgen_queue_requests", "Requests of active batches not finished yet", registry=registry)
    busy = Gauge("bulkgen_worker_busy_seconds", "Seconds each worker spent stepping its engine, over all stored "
                 "batches; rate() of it is the worker's utilisation", ["worker"], registry=registry)
    for status in ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                   "cancelled"):
        batches.labels(status).set(0)
    for record in cache.get():
        _add_record(record, batches, requests, tokens, pending)
        _add_busy(record, busy)
    queued.set(manager.queue_depth())
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _add_record(record: dict, batches, requests, tokens, pending) -> None:
    counts, usage = record["request_counts"], record["usage"]
    batches.labels(record["status"]).inc()
    requests.labels("completed").inc(counts["completed"])
    requests.labels("failed").inc(counts["failed"])
    tokens.labels("input").inc(usage["input_tokens"])
    tokens.labels("output").inc(usage["output_tokens"])
    tokens.labels("cached").inc(usage["input_tokens_details"]["cached_tokens"])
    if record["status"] in ACTIVE_STATUSES:
        pending.inc(max(0, counts["total"] - counts["completed"] - counts["failed"]))


def _add_busy(record: dict, busy) -> None:
    for worker, stats in ((record.get("metrics") or {}).get("per_worker") or {}).items():
        busy.labels(worker).inc(stats.get("busy_time_s") or 0)
