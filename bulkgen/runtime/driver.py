"""The driver: one batch's way from an input file to its results, through this process's runtime.

    store      store the input as POST /v1/files does
    store_checked  store it validated, indexed and tallied in the same pass, with the endpoint from its
               first line where none is given and a watcher's job defaults set in each line as it is
               parsed (`bulkgen run`, jobs/batch_job.py and the watcher: each line is parsed once)
    accept     create the batch (`validating`) of a stored file
    admit      POST /v1/batches after accept: validate at once under --refuse-infeasible, wake the runtime
    validate   validating -> in_progress or failed; the line index and the plan's estimate are built in the
               same streamed pass (`validate_and_index`), or taken from store_checked's pass
    hand_over  give the validated batch and its index to this process's BatchManager; returns at once
    ended      the final record once the batch has ended here (poll it), `wait` blocks on it
    finish     write the results (where is the caller's: local files, an output prefix) and forget the batch

`bulkgen run` and `jobs/batch_job.py` call `run()`, which does all of it and blocks. The watcher, a
long-lived service with many batches at once and claims to renew, calls the steps itself and polls `ended`.
The API creates each batch with `accept` and `admit` (a driver over the server's runtime) and the runtime validates it:
its runner calls `validate_and_index` too, so every door creates, validates and indexes a file the same way.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.requests import Fill, NotABatchFile
from bulkgen.batch.schema import TERMINAL_STATUSES, BatchStatus, InvalidRequest
from bulkgen.batch.service import BatchService
from bulkgen.plan.admission import raise_if_refused
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.runtime.validation import Checked, check_into, validate_and_index

if TYPE_CHECKING:  # the manager imports Ray: only a driver that runs batches needs it
    from bulkgen.runtime.manager import BatchManager

log = logging.getLogger(__name__)

HEAD_START_S = 0.5  # validation's head start: a small broken file is reported before Ray starts

Writer = Callable[[BatchRecord], list[str]]  # an ended batch's record -> what was written where


class DriverError(Exception):
    """Bad input or a failed batch, explained in words."""


def refusal(name: str, record: BatchRecord) -> str:
    """A batch that failed validation, one line per error, each naming the file and line."""
    lines = "\n".join(
        f"  {name}:{e['line']}: [{e['code']}] {e['message']}"
        if e["line"]
        else f"  {name}: [{e['code']}] {e['message']}"
        for e in record.errors["data"]
    )
    return f"{name} failed validation:\n{lines}"


class Driver:
    """Runs batches in this process. `manager`: a runtime already running here (else started on demand)."""

    def __init__(self, svc: BatchService, manager: BatchManager | None = None) -> None:
        self.svc = svc
        self.manager = manager
        self._own_runtime = manager is None  # stop() stops only a runtime this driver started
        self._handed: set[str] = set()  # batches handed to the runtime here and not finished yet
        self._stopped = threading.Event()

    # -- the steps -------------------------------------------------------------------------------------
    def accept(
        self,
        file_id: str,
        endpoint: str,
        window: str,
        metadata: dict | None = None,
        output_expires_after_s: int | None = None,
    ) -> BatchRecord:
        """Create the batch of a stored input file, in `validating`; raises InvalidRequest."""
        return self.svc.create_batch(
            file_id, endpoint, window, metadata, output_expires_after_s=output_expires_after_s
        )

    def admit(self, record: BatchRecord) -> BatchRecord:
        """POST /v1/batches' step after `accept`, over a running runtime: wake it, and its runner validates
        the batch. Under --refuse-infeasible the batch is validated, indexed and estimated here first, so an
        infeasible one is refused in the answer (InvalidRequest, a 400) and a feasible one handed over with
        its index."""
        if self.svc.settings.refuse_infeasible:
            record, index = self.validate(record.id)
            raise_if_refused(record)
            self.hand_over(record.id, index)
        self.manager.wake()
        return record

    def store(self, fileobj: BinaryIO, name: str, file_id: str | None = None) -> str:
        """Store an input file as POST /v1/files does; -> its file id (`file_id`: an id chosen before, as
        a watcher's claim does, so a retaken claim rewrites the same file)."""
        if file_id is None:
            return self.svc.files.create(fileobj, name, "batch")["id"]
        return self.svc.files.put(file_id, fileobj, name, "batch")["id"]

    def store_checked(
        self,
        fileobj: BinaryIO,
        name: str,
        endpoint: str | None,
        fill: Fill | None = None,
        file_id: str | None = None,
        found: bool = False,
    ) -> tuple[str, Checked]:
        """`store`, validating, indexing and tallying the file in the same pass, each line parsed once
        (runtime.validation.check_into): -> its file id and the pass, which `validate` takes. `endpoint`
        None: the first line's url. `fill` (a watcher's job defaults) is set in each line where it sets
        none; the file as stored is what the batch runs, as if the user wrote it. `found`: a watcher's object
        (NotABatchFile unless its first line is a JSON object)."""
        with tempfile.TemporaryFile() as stored:
            checked = check_into(self.svc, fileobj, stored, endpoint, fill, found)
            stored.seek(0)
            return self.store(stored, name, file_id), checked

    def validate(self, batch_id: str, checked: Checked | None = None) -> tuple[BatchRecord, LineIndex | None]:
        """Validate, index and estimate with the runtime's own step (no-op for a batch already validated);
        `checked`: the pass that stored its file, which is then not read again."""
        queued = self.manager.queue.pending_requests() if self.manager is not None else 0
        return validate_and_index(self.svc, batch_id, queued, checked)

    def resume(self, batch_id: str) -> tuple[BatchRecord, LineIndex | None]:
        """A batch whose driver stopped (a crash, a restart): validated now if it was left `validating`,
        and back in the active index if its creator stopped between the record and the entry."""
        found = self.validate(batch_id)
        self.svc.ensure_indexed(batch_id)
        return found

    def hand_over(self, batch_id: str, index: LineIndex | None = None) -> None:
        """The runtime here runs the batch, with the index validation built (None: it reads the file
        itself, as for a resumed batch). Returns at once; the workers start in the background."""
        self._handed.add(batch_id)
        if self.svc.batches.get(batch_id).status in TERMINAL_STATUSES:
            return  # refused by validation, or ended before a restart: no workers needed
        self.start_in_background()
        self.manager.hand_over(batch_id, index)

    def ended(self, batch_id: str) -> BatchRecord | None:
        """The final record once the batch has ended and no runner here still holds it; else None (without
        reading the record while a runner here holds it: a watcher asks every second)."""
        if self.manager is not None and self.manager.runner_of(batch_id) is not None:
            return None
        record = self.svc.batches.get(batch_id)
        return record if record.status in TERMINAL_STATUSES else None

    def finish(self, record: BatchRecord, write: Writer) -> list[str]:
        """Write an ended batch's results with `write`; the runtime forgets the batch."""
        written = write(record)
        self._handed.discard(record.id)
        if self.manager is not None:
            self.manager.forget(record.id)
        return written

    # -- the runtime -----------------------------------------------------------------------------------
    def start(self) -> BatchManager:
        """Start the runtime in the calling thread (Ray's signal handlers need the main thread), restricted
        to the batches handed to it, and have one served model loaded at once."""
        from bulkgen.runtime.manager import BatchManager

        manager = self.manager = self.manager or BatchManager(self.svc, only=set())
        manager.start()
        if len(self.svc.settings.models) == 1:
            (name, path), workers = next(iter(self.svc.settings.models.items())), self.svc.settings.workers
            manager.dispatcher.preload(name, path, workers.ranks_of(name))
        return manager

    def start_in_background(self) -> None:
        """Start the runtime in a thread of its own, once; a start that fails is tried again on the next
        call (the watcher renews its claims meanwhile)."""
        if self.manager is not None:
            return
        from bulkgen.runtime.manager import BatchManager

        manager = self.manager = BatchManager(self.svc, only=set(self._handed))

        def start() -> None:
            try:
                manager.start()
            except Exception as exc:
                log.error("workers did not start (%s: %s); trying again", type(exc).__name__, exc)
                if self.manager is manager:
                    self.manager = None
                return
            # a local Ray's processes are killed when the *thread* that started them ends (Linux
            # PR_SET_PDEATHSIG), so this thread lives as long as the driver
            self._stopped.wait()

        threading.Thread(target=start, name="bulkgen-workers", daemon=True).start()

    def stop(self) -> None:
        """Stop the runtime here; workers may be shared with a service on the same Ray: they keep running."""
        self._stopped.set()
        if self.manager is not None and self._own_runtime:
            self.manager.stop(kill_workers=False)
            self.manager = None

    # -- all of it, blocking -------------------------------------------------------------------------
    def run(
        self,
        fileobj: BinaryIO,
        name: str,
        endpoint: str | None,
        window: str,
        write: Writer | None = None,
        announce: Callable[[BatchRecord], None] | None = None,
        on_poll: Callable[[BatchRecord], None] | None = None,
    ) -> BatchRecord:
        """Store, validate, run one batch to its end and write its results; -> the final record. Ray, the
        workers and the served model start while the file is stored and validated: most of a run's fixed
        cost is theirs. A file whose validation fails within HEAD_START_S is reported before Ray starts.
        `endpoint` None: the url of the file's first request line."""
        accepted: dict = {}

        def intake() -> None:
            try:
                accepted["batch"] = self._intake(fileobj, name, endpoint, window)
            except BaseException as exc:  # raised in the caller's thread below
                accepted["error"] = exc

        thread = threading.Thread(target=intake, name="bulkgen-validate", daemon=True)
        thread.start()
        thread.join(HEAD_START_S)
        if "error" in accepted:
            raise accepted["error"]
        try:
            self.start()
            thread.join()
            if "error" in accepted:
                raise accepted["error"]
            record, index = accepted["batch"]
            if announce is not None:
                announce(record)
            self.manager.hand_over(record.id, index)
            record = self.manager.wait(record.id, on_poll=on_poll)
        finally:
            thread.join()
            self.stop()
        if write is not None:
            self.finish(record, write)
        return record

    def _intake(
        self, fileobj: BinaryIO, name: str, endpoint: str | None, window: str
    ) -> tuple[BatchRecord, LineIndex | None]:
        try:
            file_id, checked = self.store_checked(fileobj, name, endpoint)
            record = self.accept(file_id, checked.endpoint, window)
            record, index = self.validate(record.id, checked)
        except InvalidRequest as exc:
            raise DriverError(str(exc)) from None
        except NotABatchFile as exc:
            raise DriverError(exc.at(name)) from None
        if record.status == BatchStatus.FAILED:
            raise DriverError(refusal(name, record))
        return record, index
