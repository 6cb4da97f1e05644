"""The watcher: every JSONL object under an input prefix becomes a batch; its results go to an output prefix.

Each object version is claimed first (claims.py), so it is processed once across restarts and beside
other watchers on the same service storage; the batch is visible through the API like any other. Each
batch goes the driver's way (bulkgen.runtime.driver: store with the job's defaults, validated and indexed
in that same pass, accept, hand over, finish), with many batches at once: the driver's runtime runs only the batches
handed to it, so a watcher adds workers for what it finds and never takes on the API's batches, while a
`bulkgen serve` on the same storage may run the watcher's batches as well (leases keep one runner per
batch). The watcher itself polls the batch *records*, so it writes the results whoever ran the batch.
A failure with one object is logged in one line and the watcher goes on; the object is retried later.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.records import RecordNotFound
from bulkgen.batch.requests import Fill, NotABatchFile
from bulkgen.batch.resultfiles import stem_of, write_report, write_results
from bulkgen.batch.schema import InvalidRequest
from bulkgen.batch.service import BatchService
from bulkgen.runtime.driver import Driver
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.runtime.validation import Checked
from bulkgen.store import NotFound, ObjectInfo, S3Store, layout, open_store
from bulkgen.watch.claims import Claim, ClaimLost, Claims
from bulkgen.watch.cron import Cron
from bulkgen.watch.job import Job, JobError
from bulkgen.watch.sources import Message, PollTimer, SqsSource

if TYPE_CHECKING:  # Ray is imported once a batch needs workers
    from bulkgen.runtime.manager import BatchManager

log = logging.getLogger("bulkgen.watch")

TICK_S = 1.0


class Watcher:
    """`on_batch_end(record)` is called once per batch, with its final public record, after its results
    are written (where a webhook notifier plugs in); an exception in it is logged, never fatal."""

    def __init__(
        self,
        svc: BatchService,
        job: Job,
        *,
        endpoint_url: str | None = None,
        on_batch_end: Callable[[dict], None] | None = None,
        owner: str | None = None,
    ) -> None:
        self.svc, self.job, self.on_batch_end = svc, job.check(), on_batch_end
        self.owner = owner or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.inbox = open_store(job.input, endpoint_url=endpoint_url)
        self.outbox = open_store(job.output, endpoint_url=endpoint_url)
        self.outbox.create()  # a local output folder is made here, at start (stores never make their root later)
        for name, other in (("output", self.outbox), ("service storage", svc.store)):
            if _inside(other.url, self.inbox.url):
                raise JobError(
                    f"the {name} {other.url} is inside the input {self.inbox.url}: "
                    "the watcher would read what it writes"
                )
        self.claims = Claims(svc.store, self.inbox.url, self.owner, job.claim_ttl)
        self.timer = PollTimer(job.poll_interval(), Cron(job.schedule) if job.schedule else None)
        self.sqs = self._sqs(endpoint_url) if job.sqs_queue_url else None
        self.pending: dict[str, Claim] = {}  # claim name -> a claim whose batch has not ended
        self.driver = Driver(svc)
        self._stopped = threading.Event()
        self._scans = 0

    def _sqs(self, endpoint_url: str | None) -> SqsSource:
        if not isinstance(self.inbox, S3Store):
            raise JobError(f"--sqs-queue-url needs an s3:// input; {self.inbox.url} is a folder")
        return SqsSource(self.job.sqs_queue_url, self.inbox.bucket, self.inbox.root, endpoint_url)

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self, once: bool = False) -> None:
        """Watch until stop() (or, with `once`, until one poll's objects have all ended)."""
        log.info(
            "watching %s -> %s (%s%s; format %s; storage %s)",
            self.inbox.url,
            self.outbox.url,
            self.timer.describe(),
            f", sqs {self.job.sqs_queue_url}" if self.sqs else "",
            self.job.output_format,
            self.svc.store.url,
        )
        if self.sqs:
            self.sqs.start()
        try:
            while not self._stopped.is_set():
                if self.timer.due() or (once and not self._scans):
                    self._guard("scan", self.scan)
                if self.sqs:
                    for message in self.sqs.messages(timeout=TICK_S):
                        self._guard("sqs message", lambda m=message: self.on_message(m))
                self._guard("pending batches", self.check_pending)
                if once and self._scans and not self.pending:
                    return
                if not self.sqs:
                    self._stopped.wait(TICK_S)
        finally:
            self.close()

    def stop(self) -> None:
        self._stopped.set()

    def close(self) -> None:
        self._stopped.set()
        if self.sqs:
            self.sqs.stop()
        self.driver.stop()

    @property
    def manager(self) -> BatchManager | None:
        """The runtime running this watcher's batches; None until one needs workers."""
        return self.driver.manager

    def _guard(self, what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as exc:  # storage or queue down for a moment: log one line, try again next tick
            log.warning("%s failed: %s: %s", what, type(exc).__name__, _one_line(exc))

    # -- finding objects --------------------------------------------------------------------------------
    def scan(self) -> int:
        """One poll of the input prefix; -> how many objects were not finished yet."""
        done = self.claims.done_names()
        seen = todo = 0
        for info in self.inbox.list_objects(""):
            seen += 1
            name = self.claims.name(info)
            if _hidden(info.key) or name in done or name in self.pending:
                continue
            todo += 1
            self.handle(info)
        self._scans += 1
        if todo or self._scans == 1:
            log.info("scan: %d objects under %s, %d not done before", seen, self.inbox.url, todo)
        return todo

    def on_message(self, message: Message) -> None:
        """An SQS message: delete it once each object it names is durable (or finished, or gone)."""
        if message.test:
            log.info("sqs: s3:TestEvent received and ignored")
        durable = [self.handle_key(key) for key in message.keys]
        if all(durable):
            self.sqs.delete(message)

    def handle_key(self, key: str) -> bool:
        if _hidden(key):
            return True
        try:
            info = self.inbox.stat(key)
        except NotFound:  # deleted since the event: nothing to do
            return True
        except Exception as exc:
            log.warning("%s: %s: %s", key, type(exc).__name__, _one_line(exc))
            return False
        return self.handle(info)

    def handle(self, info: ObjectInfo) -> bool:
        """Claim the object version and carry it as far as it goes now; -> whether it is durable."""
        if self.claims.name(info) in self.pending:
            return True
        try:
            claim = self.claims.take(info)
            if claim is not None:
                self._advance(claim)
            return True
        except ClaimLost as exc:
            log.info("%s", exc)
            return True
        except Exception as exc:
            log.warning("%s: %s: %s (retried on a later poll)", info.key, type(exc).__name__, _one_line(exc))
            return False

    # -- an object's way ----------------------------------------------------------------------------------
    def _advance(self, claim: Claim) -> None:
        key = claim.info.key
        batch_id = claim.batch_id or (self._batch_of_file(claim.file_id) if claim.retaken else None)
        if batch_id:
            if not claim.batch_id:
                self.claims.update(claim, state="running", batch_id=batch_id)
            log.info("%s: resuming batch %s", key, batch_id)
            _, index = self.driver.resume(batch_id)
            return self._track(claim, index)
        try:
            checked = self._upload(claim)
            self.claims.update(claim, state="uploaded")  # still ours? (else the new owner creates the batch)
            record = self.driver.accept(
                claim.file_id,
                checked.endpoint,
                self.job.completion_window,
                {"watch_input": f"{self.inbox.url}/{key}"[-512:]},
            )
            # validated and indexed as it was stored: a refused file gets its report without starting any
            # worker (a crash before this leaves it `validating`, and the runtime or the next owner
            # validates the stored file)
            record, index = self.driver.validate(record.id, checked)
        except (NotABatchFile, InvalidRequest) as exc:
            written = write_report(
                self.outbox, stem_of(key) if key.endswith(".jsonl") else key, str(exc), self._source(claim)
            )
            self.claims.finish(claim, outcome="not_run")
            log.warning("%s: not run: %s (report: %s)", key, exc, written)
            return
        self.claims.update(claim, state="running", batch_id=record.id)
        log.info(
            "%s: batch %s, %d requests, %s",
            key,
            record.id,
            record.request_counts.total,
            record.status,
        )
        self._track(claim, index)

    def _upload(self, claim: Claim) -> Checked:
        """Store the input file the batch reads (the object, with the job's defaults filled in), validated
        in the same pass: each line is parsed once. NotABatchFile: no batch file at all."""
        if not claim.info.key.endswith(".jsonl"):
            raise NotABatchFile(None, "not a .jsonl object: only *.jsonl objects run as batches")
        body = self.job.body_defaults()
        fill = Fill(body, self.job.endpoint) if body or self.job.endpoint else None
        with self.inbox.open_read(claim.info.key) as src:
            _, checked = self.driver.store_checked(
                src, claim.info.key.rsplit("/", 1)[-1], self.job.endpoint, fill, claim.file_id, found=True
            )
        return checked

    def _batch_of_file(self, file_id: str) -> str | None:
        """A batch an earlier owner created from this claim's file before it could record it."""
        for key in self.svc.store.list(layout.file_refs(file_id)):
            batch_id = layout.ref_batch(key)
            try:
                self.svc.batches.get(batch_id)
                return batch_id
            except RecordNotFound:
                continue
        return None

    def _track(self, claim: Claim, index: LineIndex | None = None) -> None:
        self.pending[claim.name] = claim
        self.driver.hand_over(claim.batch_id, index)

    def check_pending(self) -> None:
        """Write the results of batches that ended; renew the claims of those still running."""
        for name, claim in list(self.pending.items()):
            try:
                record = self.driver.ended(claim.batch_id)
                if record is not None:
                    self._finish(claim, record)
                    del self.pending[name]
                    continue
                self.driver.start_in_background()  # (again, if the workers failed to start)
                if self.claims.renew_due(claim):
                    self.claims.update(claim)
            except ClaimLost as exc:
                log.info("%s", exc)
                del self.pending[name]
            except Exception as exc:
                log.warning(
                    "%s: batch %s: %s: %s", claim.info.key, claim.batch_id, type(exc).__name__, _one_line(exc)
                )

    def _finish(self, claim: Claim, record: BatchRecord) -> None:
        stem = stem_of(claim.info.key)
        written = self.driver.finish(
            record,
            lambda r: write_results(
                self.svc, r, self.outbox, stem, self.job.output_format, self._source(claim)
            ),
        )
        self.claims.finish(claim, outcome=record.status)
        counts = record.request_counts
        log.info(
            "%s: batch %s %s: %d completed, %d failed; wrote %s",
            claim.info.key,
            record.id,
            record.status,
            counts.completed,
            counts.failed,
            ", ".join(written),
        )
        if self.on_batch_end is not None:
            try:
                self.on_batch_end(record.public())
            except Exception as exc:
                log.warning(
                    "batch %s: on_batch_end failed: %s: %s", record.id, type(exc).__name__, _one_line(exc)
                )

    def _source(self, claim: Claim) -> dict:
        return {
            "input": self.inbox.url,
            "key": claim.info.key,
            "etag": claim.info.etag,
            "size": claim.info.size,
            "claim": claim.name,
        }


def _hidden(key: str) -> bool:
    """'.name' objects are skipped: uploads in progress (rsync, editors) and markers, not batch files."""
    return key.rsplit("/", 1)[-1].startswith(".")


def _inside(url: str, folder: str) -> bool:
    return url == folder or url.startswith(folder.rstrip("/") + "/")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500]
