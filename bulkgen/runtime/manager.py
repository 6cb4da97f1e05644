"""The batch manager of one service replica: claims active batches, runs them together, keeps leases.

At once when a batch is created or cancelled here, and otherwise with a back-off (every 2 s at first,
up to once a minute while nothing changes: bulkgen.runtime.pacing), it scans the storage's
index of active batches and takes the lease of any that no live runner holds: batches accepted by
this replica, left behind by a replica that died, or by a previous run of this one. Each claimed batch
gets a runner thread; all runners share one work queue and the worker pool, so several batches run at
once. Leases are renewed here; a runner whose lease was taken stops without writing anything.

An index entry whose record cannot be read yet is a batch still being created (the record is written
first, but a slow write may show the entry alone): its runner gives it up and a later scan tries again.
After UNCREATED_AFTER_S the entry is a leftover of a creator that died between its writes, and is dropped.

The manager thread also hands the C heap's free pages back to the system every 30 s while batches
run, and once each runner ends (what its finalize merged): freed memory otherwise stays in glibc's arenas
(bulkgen.batch.heap_trim.PeriodicTrim).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.heap_trim import PeriodicTrim
from bulkgen.batch.ids import id_time
from bulkgen.batch.records import RecordNotFound
from bulkgen.batch.schema import TERMINAL_STATUSES
from bulkgen.batch.service import BatchService
from bulkgen.runtime.dispatch import Dispatcher
from bulkgen.runtime.lease import Lease, LeaseLost
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.runtime.pacing import CONTROL_QUIET_S, Backoff
from bulkgen.runtime.pool import WorkerPool
from bulkgen.runtime.runner import BatchRunner, NotCreatedYet
from bulkgen.runtime.workqueue import WorkQueue
from bulkgen.store import StorageUnavailable

log = logging.getLogger(__name__)

UNCREATED_AFTER_S = 600.0  # an index entry this old without a record: its creator died


class BatchManager:
    def __init__(
        self,
        svc: BatchService,
        only: set[str] | None = None,
        weights: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """`weights`: tenants' share weights read live (a keys file's); they win over settings.tenant_weights."""
        s = svc.settings
        self.svc = svc
        self.only = only  # run just these batches (`bulkgen run`, a stored job)
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.pool = WorkerPool(s.workers, s.rank_counts())
        self.queue = WorkQueue(
            self.pool.count,
            s.fair_share_after_s,
            lambda: {**s.tenant_weights, **(weights() if weights else {})},
        )
        self.dispatcher = Dispatcher(self.pool, self.queue, s.endpoint_url, self.runner_of, self.owner)
        self.runners: dict[str, BatchRunner] = {}
        self._indexes: dict[str, LineIndex] = {}  # handed over by a driver here, until a runner takes them
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._renewed = 0.0
        self._trim = PeriodicTrim()
        self._scan_pace = Backoff(s.scan_every_s)
        self._soon = threading.Event()
        self._active_seen: set[str] = set()

    def start(self) -> None:
        self.pool.start()
        self.dispatcher.start()
        threading.Thread(target=self._loop, name="bulkgen-batches", daemon=True).start()

    def stop(self, kill_workers: bool = True) -> None:
        self._stopped.set()
        self._wake.set()
        self.dispatcher.stop()
        if kill_workers:
            self.pool.shutdown()

    def wake(self, batch_id: str | None = None) -> None:
        """A batch was created or cancelled here: look now."""
        runner = self.runner_of(batch_id) if batch_id else None
        if runner is not None:
            runner.poke()
        self._wake.set()

    def hand_over(self, batch_id: str, index: LineIndex | None = None) -> None:
        """Run a batch validated in this process (bulkgen.runtime.driver), with the line index its
        validation built, so its runner does not read the file again; look now."""
        with self._lock:
            if index is not None:
                self._indexes[batch_id] = index
            if self.only is not None:
                self.only.add(batch_id)
        self._wake.set()

    def forget(self, batch_id: str) -> None:
        """The driver is done with the batch (another replica may have run it: its index is dropped here)."""
        with self._lock:
            self._indexes.pop(batch_id, None)
            if self.only is not None:
                self.only.discard(batch_id)

    def runner_of(self, batch_id: str) -> BatchRunner | None:
        with self._lock:
            return self.runners.get(batch_id)

    def queue_depth(self) -> int:
        return self.queue.batches_waiting()

    def wait(self, batch_id: str, poll_s: float = 0.5, on_poll=None) -> BatchRecord:
        """Block until the batch has ended (for `bulkgen run` and stored jobs); `on_poll(record)` sees
        each look at it (a progress bar). While a runner here holds the batch, each look is the record its
        last progress write left (no read of storage); otherwise the record is read every `poll_s`."""
        down_since = None
        while True:
            runner = self.runner_of(batch_id)
            if runner is not None:
                if runner.progress_written.wait(CONTROL_QUIET_S):
                    runner.progress_written.clear()
                if on_poll is not None and runner.last_record is not None:
                    on_poll(runner.last_record)
                continue
            try:
                record = self.svc.batches.get(batch_id)  # the caller's tenant: its own batch
                down_since = None
            except StorageUnavailable:  # as long as a runner would wait for it, then give up
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since >= self.svc.settings.storage_outage_timeout_s:
                    raise
                time.sleep(poll_s)
                continue
            if on_poll is not None:
                on_poll(record)
            if record.status in TERMINAL_STATUSES and self.runner_of(batch_id) is None:
                return record
            time.sleep(poll_s)

    # -- the manager thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        """Scan when woken or when the back-off says (bulkgen.runtime.pacing), renew leases every ttl/3."""
        ttl = self.svc.settings.lease_ttl_s
        next_scan = 0.0
        while not self._stopped.is_set():
            woken = self._wake.is_set() and not self._soon.is_set()
            self._wake.clear()
            if self._soon.is_set():  # a runner stopped: its batch may need another (after an outage)
                self._soon.clear()
                self._scan_pace.reset()
                next_scan = min(next_scan, time.monotonic() + self._scan_pace.next())
            try:
                if woken or time.monotonic() >= next_scan:
                    if self._scan() or woken:
                        self._scan_pace.reset()
                    next_scan = time.monotonic() + self._scan_pace.next()
                if self.runners and time.monotonic() - self._renewed >= ttl / 3:
                    self._renew()
                if self.runners:
                    self._trim()
            except StorageUnavailable as exc:  # storage down: say so in one line, try again soon
                log.warning("batch manager: %s", exc)
                self._scan_pace.reset()
                next_scan = time.monotonic() + self._scan_pace.next()
            except Exception:
                log.exception("batch manager: scan failed")
            wait = next_scan - time.monotonic()
            if self.runners:
                wait = min(wait, self._renewed + ttl / 3 - time.monotonic())
            self._wake.wait(max(0.05, wait))

    def _scan(self) -> bool:
        """Claim the active batches no live runner holds; -> whether anything changed since the last scan
        (a batch came or went, or one was claimed here)."""
        with self._lock:
            handed_before = set(self._indexes)
        active, claimed = set(), False
        for tenant, batch_id in self.svc.active_batches():
            active.add(batch_id)
            if (self.only is not None and batch_id not in self.only) or self.runner_of(batch_id):
                continue
            svc = self.svc.for_tenant(tenant)
            lease = Lease(svc.store, batch_id, self.owner, svc.settings.lease_ttl_s)
            if not lease.acquire():
                continue
            claimed = True
            with self._lock:
                index = self._indexes.pop(batch_id, None)
                runner = self.runners[batch_id] = BatchRunner(
                    svc, self.queue, self.dispatcher, lease, batch_id, index
                )
            threading.Thread(
                target=self._run, args=(runner,), name=f"bulkgen-run-{batch_id}", daemon=True
            ).start()
        with self._lock:  # a handed-over batch that another replica ran to its end: its index is not needed
            for batch_id in handed_before - active:
                self._indexes.pop(batch_id, None)
        changed, self._active_seen = claimed or active != self._active_seen, active
        return changed

    def _run(self, runner: BatchRunner) -> None:
        try:
            runner.run()
        except NotCreatedYet:
            self._not_created_yet(runner)
        except Exception as exc:
            log.exception("batch %s: runner failed", runner.batch_id)
            runner.fail(f"internal error while running the batch: {type(exc).__name__}: {exc}")
        finally:
            self.dispatcher.forget_batch(runner.batch_id)
            with self._lock:
                self.runners.pop(runner.batch_id, None)
            runner.progress_written.set()  # a waiter here looks now
            self._trim(now=True)  # what the batch's finalize read and merged
            self._soon.set()
            self._wake.set()
            try:
                if runner.svc.batches.get(runner.batch_id).status in TERMINAL_STATUSES:
                    runner.lease.release()
            except (StorageUnavailable, RecordNotFound):  # the lease lapses by itself, or is already released
                pass

    def _not_created_yet(self, runner: BatchRunner) -> None:
        runner.lease.release()
        made = id_time(runner.batch_id)
        if made is None or time.time() - made >= UNCREATED_AFTER_S:
            log.warning(
                "batch %s: in the active index for %.0f s without a record (its creator stopped between "
                "writes); dropped from the index",
                runner.batch_id,
                time.time() - (made or 0),
            )
            runner.svc.drop_from_index(runner.batch_id)
        else:
            log.debug("batch %s: no record yet; looking again on the next scan", runner.batch_id)

    def _renew(self) -> None:
        self._renewed = time.monotonic()
        with self._lock:
            runners = list(self.runners.values())
        for runner in runners:
            try:
                runner.lease.renew()
            except LeaseLost:
                runner.lease_lost()
