"""Prometheus metrics for the service: the running totals of ended batches plus the live ones.

A scrape reads the running totals (bulkgen.batch.totals: one object, updated when a batch ends) and the
records of the batches in the active index, so it costs the same with 10 or 10,000 stored batches. Both
cover every tenant: /metrics shows service-wide totals only.
"""

from __future__ import annotations

import copy
import threading
import time

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bulkgen.batch import totals as running_totals
from bulkgen.batch.schema import ACTIVE_STATUSES, BatchStatus


class RecordCache:
    """(totals of ended batches, records of live batches), re-read at most every few seconds however
    often Prometheus scrapes."""

    def __init__(self, svc, max_age_s: float = 5.0) -> None:
        self.svc, self.max_age_s = svc, max_age_s
        self.at, self.value = float("-inf"), (running_totals.empty(), [])
        self._lock = threading.Lock()

    def get(self) -> tuple[dict, list[dict]]:
        with self._lock:
            if time.monotonic() - self.at > self.max_age_s:
                self.value = (running_totals.load(self.svc.root), list(self._live()))
                self.at = time.monotonic()
            return self.value

    def _live(self):
        for tenant, batch_id in self.svc.active_batches():  # every tenant's: the totals are service-wide
            try:
                record = self.svc.for_tenant(tenant).batches.get(batch_id)
            except LookupError:  # ended and removed between listing and reading
                continue
            if record.status in ACTIVE_STATUSES:  # an ended one is in the totals (or about to be)
                yield record


def render_metrics(cache: RecordCache, manager) -> tuple[bytes, str]:
    registry = CollectorRegistry()
    batches = Gauge("bulkgen_batches", "Batches by status", ["status"], registry=registry)
    requests = Gauge(
        "bulkgen_requests", "Requests by outcome, over all stored batches", ["outcome"], registry=registry
    )
    tokens = Gauge("bulkgen_tokens", "Tokens processed, over all stored batches", ["kind"], registry=registry)
    queued = Gauge("bulkgen_queue_batches", "Batches waiting for the worker pool", registry=registry)
    pending = Gauge(
        "bulkgen_queue_requests", "Requests of active batches not finished yet", registry=registry
    )
    busy = Gauge(
        "bulkgen_worker_busy_seconds",
        "Seconds each worker spent stepping its engine, over all stored "
        "batches; rate() of it is the worker's utilisation",
        ["worker"],
        registry=registry,
    )
    ended, live = cache.get()
    total = copy.deepcopy(ended)
    waiting = 0
    for record in live:
        running_totals.add(total, record)
        counts = record.request_counts
        waiting += max(0, counts.total - counts.completed - counts.failed)
    for status in BatchStatus:
        batches.labels(status.value).set(total["batches"].get(status, 0))
    for outcome, value in total["requests"].items():
        requests.labels(outcome).set(value)
    for kind, value in total["tokens"].items():
        tokens.labels(kind).set(value)
    for worker, seconds in total["worker_busy_s"].items():
        busy.labels(worker).set(seconds)
    _adapters(registry, total.get("adapters", {}))
    _workers_now(registry, manager)
    pending.set(waiting)
    queued.set(manager.queue_depth())
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _workers_now(registry: CollectorRegistry, manager) -> None:
    """Each worker's share of the last 30 s spent stepping its engine, from the worker's own count: a
    worker stepping anything is busy here, whether or not the work is a live batch's (the batch totals
    above count only what batches recorded)."""
    share = Gauge(
        "bulkgen_worker_busy_ratio",
        "Share of the last 30 s each worker spent stepping its engine, whatever it ran",
        ["worker"],
        registry=registry,
    )
    dispatcher = getattr(manager, "dispatcher", None)
    for worker in dispatcher.worker_states() if dispatcher is not None else []:
        share.labels(worker["id"]).set(worker["busy_share"])


def _adapters(registry: CollectorRegistry, adapters: dict[str, dict]) -> None:
    """Each LoRA adapter's requests and tokens (labelled by its name: one series per served adapter)."""
    requests = Gauge(
        "bulkgen_adapter_requests",
        "Requests each LoRA adapter ran, over all stored batches",
        ["adapter"],
        registry=registry,
    )
    tokens = Gauge(
        "bulkgen_adapter_tokens",
        "Tokens each LoRA adapter processed, over all stored batches",
        ["adapter", "kind"],
        registry=registry,
    )
    for name, counts in adapters.items():
        requests.labels(name).set(counts["requests"])
        tokens.labels(name, "input").set(counts["input_tokens"])
        tokens.labels(name, "output").set(counts["output_tokens"])
