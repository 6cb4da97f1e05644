"""The engine worker's writer thread: stores each finished range's result part, off the step loop, and
keeps trying while storage is down, unless the range's driver is gone (see ORPHAN_AFTER_S). Between parts
it hands the C heap's free pages back to the system every 30 s (heap_trim.PeriodicTrim): what ranges
were read, prepared and written from is freed into glibc's arenas, where it can otherwise stay."""

from __future__ import annotations

import logging
import time

from bulkgen.batch import health
from bulkgen.batch.outputlines import json_line, success_line
from bulkgen.runtime.engine_loop import os_thread_name
from bulkgen.runtime.held import HeldRange
from bulkgen.runtime.parts import write_part
from bulkgen.runtime.ranges import RangeOutcome
from bulkgen.store import StorageUnavailable

log = logging.getLogger("bulkgen.runtime.worker")

# A driver that has not polled for this long is gone (its process or its head died): parts of its ranges
# are no longer stored, so a service restarted on the same storage can finalize without this worker
# writing after it (the runner that takes the batch over waits this out: bulkgen.runtime.lease).
ORPHAN_AFTER_S = 10.0


class PartWriter:
    """EngineWorker's writer-thread methods (a mixin over the worker's state, guarded by its `_cond`)."""

    def _write_loop(self) -> None:
        os_thread_name(f"bg-writer-{self.index}")
        while True:
            work = self._writes.get()
            try:
                if self._store_until_done(work):
                    with self._cond:
                        self._done[self._owner_of.get(work.batch_id, "")].append(work.outcome())
                        self._cond.notify_all()
            except Exception:  # the range is not reported done, so the driver will hand it out again
                log.exception("worker %d: could not store a part of %s", self.index, work.batch_id)
            finally:
                self._writes.task_done()
                self._trim()

    def _store_until_done(self, work: HeldRange) -> bool:
        """Storage down: keep the results and try again (the part write is idempotent) until it answers
        or the batch is withdrawn from this worker (its runner gave up; a resumed one redoes the range)."""
        delay = 0.5
        while True:
            if self._orphaned(work):
                return False
            try:
                self._store_part(work)
                return True
            except StorageUnavailable as exc:
                log.warning("worker %d: part of %s not stored yet: %s", self.index, work.batch_id, exc)
            with self._cond:
                if work.batch_id in self._stopped:
                    return False
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def _orphaned(self, work: HeldRange) -> bool:
        """True when the driver of `work` stopped polling ORPHAN_AFTER_S ago: its part is not stored. The
        range is handed back (no attempt used) in case that driver was only slow and polls again."""
        with self._cond:
            owner = self._owner_of.get(work.batch_id, "")
            last = self._polled.get(owner)
            if last is None or self.clock() - last < ORPHAN_AFTER_S:
                return False
            self._done[owner].append(
                RangeOutcome(work.bounds, error="its driver stopped polling", storage_down=True)
            )
        log.warning(
            "worker %d: driver %s silent for %.0f s; part %s-%s of %s not stored",
            self.index,
            owner or "-",
            self.clock() - last,
            work.bounds.first_line,
            work.bounds.last_line,
            work.batch_id,
        )
        return True

    def _store_part(self, work: HeldRange) -> None:
        for entry, request, result in work.answers:
            line = success_line(request, result, request.lora or work.model)
            health.observe(work.health, request, line["response"]["body"])
            entry.envelope = json_line(line)
        work.answers.clear()
        write_part(work.store, work.batch_id, work.bounds.first_line, work.bounds.last_line, work.entries)
