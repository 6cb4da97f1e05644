"""One runner per batch, in the driver: index its input, queue what has no result yet, watch, finalize.

Everything a runner needs to resume lives in storage: the batch record, the input file and the result
parts, so a runner that died is replaced by one (here or on another replica, once its lease lapsed)
that queues only the lines without a part.

Storage that stops answering: each store call retries for a few seconds itself; a runner that still
cannot reach storage keeps trying for `storage_outage_timeout_s`, then stops (one error line in the log)
and withdraws its work from the workers. It cannot record anything while storage is down, so the batch
stays active with its parts and lease; once storage answers again the manager's next scan (in this
process, or in a restarted service) starts a new runner that resumes from the stored parts.

The runner never holds the file or the results: it holds the line index, a done-mask over it, the
counts, and the batch's metrics (bounded sketches).
"""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np

from bulkgen.batch import lifecycle
from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.lifecycle import needs_validation
from bulkgen.batch.outputlines import refused_line
from bulkgen.batch.records import FileRepo, RecordNotFound
from bulkgen.batch.requests import custom_id_of
from bulkgen.batch.schema import TERMINAL_STATUSES, BatchStatus, batch_priority
from bulkgen.batch.service import BatchService
from bulkgen.metrics import BatchMetrics
from bulkgen.runtime import parts
from bulkgen.runtime.finalize import finalize
from bulkgen.runtime.lease import Lease, LeaseLost
from bulkgen.runtime.lineindex import LineIndex, index_file, read_lines
from bulkgen.runtime.pacing import CONTROL_QUIET_S, PUBLISH_QUIET_S, PUBLISH_STEPS, ProgressPacer
from bulkgen.runtime.ranges import RangeOutcome
from bulkgen.runtime.validation import validate_and_index
from bulkgen.runtime.workqueue import QueuedBatch, QueuedRange, make_ranges
from bulkgen.store import NotFound, StorageUnavailable, layout
from bulkgen.store.base import redact

log = logging.getLogger(__name__)


class StorageOutage(Exception):
    """Storage stayed unavailable past the outage timeout: the runner stops and the batch stays active."""


class NotCreatedYet(Exception):
    """The active index names a batch with no record (yet): its creator is between writes, or died. Not a
    failure: the runner gives the batch up, and a later scan looks again (BatchManager)."""


class BatchFailed(Exception):
    """The batch cannot run at all (its input is gone, its model cannot load): it ends `failed`."""


class BatchRunner:
    def __init__(
        self,
        svc: BatchService,
        queue,
        dispatcher,
        lease: Lease,
        batch_id: str,
        index: LineIndex | None = None,
    ) -> None:
        """`index`: the line index a driver in this process built as it validated the batch (else the
        runner validates and indexes a batch in `validating` in one pass, or reads a validated one)."""
        self.svc, self.queue, self.dispatcher, self.lease = svc, queue, dispatcher, lease
        self.batch_id = batch_id
        self.metrics = self._load_metrics()
        self.index: LineIndex | None = index
        self.done: np.ndarray | None = None
        self.tally = parts.Tally()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._fatal: str | None = None
        self._lease_lost = False
        self._started = time.time()
        self._done_here = 0
        self._live: dict[str, dict] = {}  # per worker: requests settled in ranges not yet written
        self._outage_since: float | None = None
        self._poked = threading.Event()
        self._seen_at = time.monotonic()
        self._settled_before = 0  # requests with a result when this runner started
        self.progress_written = threading.Event()  # set by each progress write, for a waiter here
        self.last_record: BatchRecord | None = None  # as the last progress write left it
        self._state_at = float("-inf")  # when the metrics state was last stored

    # -- the runner's thread ---------------------------------------------------------------------------
    def run(self) -> BatchRecord | None:
        try:
            return self._run()
        except LeaseLost:
            log.warning("batch %s: lease lost; another runner has it", self.batch_id)
            self._withdraw(None)
            return self.svc.batches.get(self.batch_id)
        except BatchFailed as exc:
            return self.fail(str(exc))
        except (StorageOutage, StorageUnavailable) as exc:
            log.error(
                "batch %s: runner stopped: %s; the batch stays active and resumes from its stored parts "
                "once storage answers",
                self.batch_id,
                exc,
            )
            self._withdraw(None)
            return None

    def _run(self) -> BatchRecord:
        record, index = self._validate()
        if record.status in TERMINAL_STATUSES:
            self.svc.mark_ended(self.batch_id, record)
            return record
        self._log_start()
        stop = self.stop_reason(record)
        if record.status != BatchStatus.FINALIZING:
            if index is not None or self.index is None:  # else: handed over by the driver that validated it
                self.index = index if index is not None else self._index_file(record)
            self.done, self.tally = parts.coverage(self.svc.store, self.batch_id, self.index)
            self._settled_before = int(self.done.sum())
            if not stop and not self.done.all():
                stop = self._execute(record)
            if stop:
                self._withdraw(stop)  # the rest never run: finalize writes their error lines
        self.lease.wait_for_orphans(self._check_lease)  # a dead driver's workers may still store parts
        return finalize(self.svc, self.batch_id, stop, self.metrics, self.index)

    def _check_lease(self) -> None:
        if self._lease_lost:
            raise LeaseLost(self.batch_id)

    def _execute(self, record: BatchRecord) -> str | None:
        order = record.expires_at if self.svc.settings.scheduling == "deadline" else record.created_at
        batch = QueuedBatch(
            self.batch_id,
            FileRepo.data_key(record.input_file_id),
            record.endpoint,
            record.model,
            self.svc.settings.models[record.model],
            float(order),
            self.svc.store.open_args(),
            self.svc.tenant,
            batch_priority(record.metadata),
            self.svc.catalog.of_base(record.model, self.svc.tenant),  # those its tenant may run
            self.svc.settings.workers.ranks_of(record.model),
            self.svc.settings.workers.reasoning_parser_of(record.model),
            self.svc.settings.workers.template_options_of(record.model),
            self.svc.settings.workers.tool_parser_of(record.model),
            self.svc.settings.workers.thinking_budget_of(record.model),
            self.svc.settings.endpoint_url,
        )
        ranges = make_ranges(batch, self.index, ~self.done, self.svc.settings.range_size)
        self.queue.add_batch(batch, self.index, ranges)
        # on a local folder a write costs nothing: progress every PUBLISH_FLOOR_S, as `bulkgen run` shows it
        steps = PUBLISH_STEPS if self.svc.store.billed_requests else max(1, len(self.index))
        self._pacer = ProgressPacer(len(self.index), steps=steps, last_settled=self.settled())
        self._seen, self._seen_at = record, time.monotonic()  # the record as last read (cancel shows there)
        while True:
            self._wake.wait(0.5)
            self._wake.clear()
            if self._lease_lost:
                raise LeaseLost(self.batch_id)
            if self._fatal:
                raise BatchFailed(self._fatal)
            with self._lock:
                finished = bool(self.done.all())
            try:
                if finished:
                    self.queue.remove_batch(self.batch_id)
                    self._store_metrics_state()  # finalize writes the counts, with its status change
                    return None
                stop = self._control()
                if stop:
                    return stop
                self._outage_since = None
            except StorageUnavailable as exc:
                self._storage_down(exc)

    def _control(self) -> str | None:
        """Progress written when due (bulkgen.runtime.pacing), and the stop reason: the record is read
        when poked (a cancel here), with each progress write, or every CONTROL_QUIET_S without one."""
        now = time.monotonic()
        settled = self.settled()
        if self._poked.is_set() or now - self._seen_at >= CONTROL_QUIET_S:
            self._poked.clear()
            self._seen, self._seen_at = self.svc.batches.get(self.batch_id), now
        elif self._pacer.due(settled, now):
            self._seen, self._seen_at = self.publish(), now
            self._pacer.written(settled, now)
        return self.stop_reason(self._seen)

    def settled(self) -> int:
        """Requests with a result: in written ranges, and those workers report in open ones."""
        with self._lock:
            live = sum(c.get("completed", 0) + c.get("failed", 0) for c in self._live.values())
            return self._settled_before + self._done_here + live

    def _storage_down(self, exc: StorageUnavailable) -> None:
        """Keep the workers going (they hold their results) until the outage lasts too long."""
        timeout = self.svc.settings.storage_outage_timeout_s
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("batch %s: %s; waiting up to %.0f s for it", self.batch_id, exc, timeout)
        elif time.monotonic() - self._outage_since >= timeout:
            raise StorageOutage(f"{exc} (for {timeout:.0f} s)")

    def _validate(self) -> tuple[BatchRecord, LineIndex | None]:
        """A batch in `validating` is checked and indexed in one streamed pass; -> (record, index if built)."""
        try:
            record = self.svc.batches.get(self.batch_id)
        except RecordNotFound:
            raise NotCreatedYet(self.batch_id) from None
        if not needs_validation(record):
            return record, None
        try:
            return validate_and_index(self.svc, self.batch_id, self.queue.pending_requests())
        except (NotFound, LookupError):
            raise BatchFailed("the input file is gone; the batch cannot run") from None

    def _index_file(self, record: BatchRecord) -> LineIndex:
        try:
            with self.svc.files.open(record.input_file_id) as f:
                return index_file(f, record.endpoint)
        except (NotFound, LookupError):
            raise BatchFailed(
                f"the input file {record.input_file_id} is gone; the batch cannot run"
            ) from None

    def _log_start(self) -> None:
        """The runner note beside the parts: who ran the batch and when (a replica's takeover shows here)."""
        key = layout.runner_note(self.batch_id, self.lease.owner)
        self.svc.store.write_bytes(
            key, json.dumps({"owner": self.lease.owner, "started_at": time.time()}).encode()
        )

    # -- calls from the dispatcher's threads ------------------------------------------------------------
    def range_done(self, outcome: RangeOutcome) -> None:
        lo, hi = outcome.bounds.lo, outcome.bounds.hi
        with self._lock:
            if self.done is None or self.done[lo:hi].all():
                return  # a duplicate (a range retried after its first worker was presumed dead)
            if self.done[lo:hi].any():
                self._recount(lo, hi)
            else:
                self.tally.merge(outcome.tally)
                for m in outcome.requests:
                    self.metrics.add_request(m)
                if outcome.health:
                    self.metrics.health.merge(outcome.health)
            self.done[lo:hi] = True
            self._done_here += hi - lo
        self._wake.set()

    def live_progress(self, worker: str, counts: dict | None) -> None:
        with self._lock:
            self._live[worker] = counts or {}

    def add_steps(self, worker: str, records: list[dict]) -> None:
        with self._lock:
            self.metrics.add_steps(worker, records)

    def give_up(self, r: QueuedRange, reason: str) -> None:
        """A request that kept killing its worker: an engine_error line, so the batch can finish."""
        self.refuse_range(r, "engine_error", f"{reason}; it was not retried again")

    def refuse_range(self, r: QueuedRange, code: str, message: str, param: str | None = None) -> None:
        """Every line of `r` fails with `code` (a 400 unless engine_error), written as its part, and the
        batch goes on: e.g. model_not_loaded for the lines of a model its worker refused at load. The
        message as the client reads it (_client_text)."""
        b, message = r.bounds, self._client_text(message)
        lines = read_lines(self.svc.store, r.batch.input_key, b.first_line, b.start, b.end)
        entries = [
            parts.PartEntry.of(line, False, refused_line(custom_id_of(raw), message, code, param))
            for line, raw in lines
        ]
        parts.write_part(self.svc.store, self.batch_id, b.first_line, b.last_line, entries)
        self.range_done(RangeOutcome(b, parts.Tally(failed=len(entries))))

    def _client_text(self, message: str) -> str:
        """An internal error as the batch's client reads it: the storage root and the tenant's folder (in
        an OS error's path, say) written `<storage>`; the log keeps them."""
        return redact(message, self.svc.store.url, self.svc.root.url)

    def fatal(self, message: str) -> None:
        self._fatal = message
        self._wake.set()

    def lease_lost(self) -> None:
        self._lease_lost = True
        self._wake.set()

    def poke(self) -> None:
        """Look at the record now (it was cancelled), not at the next control tick."""
        self._poked.set()
        self._wake.set()

    # -- progress ----------------------------------------------------------------------------------------
    def stop_reason(self, record: BatchRecord | None = None) -> str | None:
        """'batch_cancelled' or 'batch_expired' when the batch must stop now, else None."""
        record = record or self.svc.batches.get(self.batch_id)
        if record.status == BatchStatus.CANCELLING:
            return "batch_cancelled"
        if time.time() >= record.expires_at:
            return "batch_expired"
        return None

    def publish(self) -> BatchRecord:
        """Keep request_counts, usage, metrics and the time-to-completion estimate current. The metrics
        state (what a resumed runner reports from) is stored at most once per PUBLISH_QUIET_S, and when the
        last range is in: counts come back from the parts, metrics only from it."""
        with self._lock:
            tally = parts.Tally(**self.tally.__dict__)
            for counts in self._live.values():  # written ranges, plus what finished in open ones
                tally.completed += counts.get("completed", 0)
                tally.failed += counts.get("failed", 0)
            summary = self.metrics.summary() if self.metrics.totals["requests"] else None
            remaining = int((~self.done).sum()) if self.done is not None else None
        if time.monotonic() - self._state_at >= PUBLISH_QUIET_S:
            self._store_metrics_state()
        if summary is not None:
            eta = self._eta(remaining)
            if eta["estimated_completion_at"] is None:  # nothing measured yet: keep the plan's estimate
                del eta["estimated_completion_at"]
            summary.update(eta)

        def apply(r: BatchRecord) -> BatchRecord:
            tally.apply(r)
            r.metrics = {**(r.metrics or {}), **summary} if summary else r.metrics
            return r

        self.last_record = self.svc.batches.update(self.batch_id, apply)
        self.progress_written.set()
        return self.last_record

    def _store_metrics_state(self) -> None:
        with self._lock:
            state = json.dumps(self.metrics.to_state()).encode()
        self.svc.store.write_bytes(self._metrics_key, state)
        self._state_at = time.monotonic()

    def _eta(self, remaining: int | None) -> dict:
        """From the throughput this runner has measured: hosted APIs leave their users polling blind."""
        elapsed = time.time() - self._started
        if not remaining or not self._done_here or elapsed <= 0:
            return {"eta_s": 0.0 if remaining == 0 else None, "estimated_completion_at": None}
        eta = remaining / (self._done_here / elapsed)
        return {"eta_s": round(eta, 1), "estimated_completion_at": int(time.time() + eta)}

    # -- endings ------------------------------------------------------------------------------------------
    def _withdraw(self, code: str | None) -> None:
        """Take the batch off the queue and the workers; with `code`, they store what they hold."""
        self.queue.remove_batch(self.batch_id)
        self.dispatcher.abort_batch(self.batch_id, code)
        with self._lock:
            self._live.clear()

    def _recount(self, lo: int, hi: int) -> None:
        """A range overlapping results already counted: count only its new lines, from its stored part."""
        lines = set(int(x) for x, d in zip(self.index.lines[lo:hi], self.done[lo:hi], strict=True) if not d)
        first, last = int(self.index.lines[lo]), int(self.index.lines[hi - 1])
        for e in parts.read_part(self.svc.store, layout.part(self.batch_id, first, last)):
            if e.line in lines:
                self.tally.add(e)

    def fail(self, message: str) -> BatchRecord:
        log.error("batch %s failed: %s", self.batch_id, message)
        self._withdraw(None)
        message = self._client_text(message)

        record = self.svc.batches.update(
            self.batch_id, lambda r: lifecycle.fail_unless_ended(r, "batch_failed", message)
        )
        self.svc.mark_ended(self.batch_id, record)
        return record

    @property
    def _metrics_key(self) -> str:
        return layout.metrics_state(self.batch_id)

    def _load_metrics(self) -> BatchMetrics:
        try:
            return BatchMetrics.from_state(json.loads(self.svc.store.read_bytes(self._metrics_key)))
        except (NotFound, ValueError, KeyError):
            return BatchMetrics()
