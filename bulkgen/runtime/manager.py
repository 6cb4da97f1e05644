"""The service's batch queue: runs batches one at a time over the shared worker pool, FIFO.

On start it resumes every batch left active in storage (a previous process died, or another replica
gave up), so nothing accepted is lost across restarts.
"""

from __future__ import annotations

import logging
import queue
import threading

from bulkgen.batch.schema import ACTIVE_STATUSES, set_status
from bulkgen.config import Context
from bulkgen.runtime.pool import WorkerPool
from bulkgen.runtime.runner import BatchRunner

log = logging.getLogger(__name__)


class BatchManager:
    def __init__(self, ctx: Context, pool: WorkerPool) -> None:
        self.ctx, self.pool = ctx, pool
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="bulkgen-batches", daemon=True)
        self.current: str | None = None

    def start(self) -> None:
        self.pool.start()
        for batch_id in reversed(list(self.ctx.batches.ids())):  # oldest first
            if self.ctx.batches.get(batch_id)["status"] in ACTIVE_STATUSES:
                self.enqueue(batch_id)
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)

    def enqueue(self, batch_id: str) -> None:
        with self._lock:
            if batch_id in self._queued:
                return
            self._queued.add(batch_id)
        self._queue.put(batch_id)

    def expedite(self, batch_id: str) -> None:
        """Close a cancelled batch that waits behind others now, not when its turn comes.

        The running batch's dispatcher sees the cancel itself within a second; a queued one is finished
        here without touching the workers (a stopped runner never loads a model).
        """
        if self.current != batch_id:
            threading.Thread(target=run_batch, args=(self.ctx, self.pool, batch_id), daemon=True).start()

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def _loop(self) -> None:
        while (batch_id := self._queue.get()) is not None:
            self.current = batch_id
            try:
                run_batch(self.ctx, self.pool, batch_id)
            finally:
                self.current = None
                with self._lock:
                    self._queued.discard(batch_id)


def run_batch(ctx: Context, pool: WorkerPool, batch_id: str) -> dict:
    """Run one batch to a terminal status; an unexpected failure fails the batch with its reason."""
    try:
        return BatchRunner(ctx, pool, batch_id).run()
    except Exception as exc:
        log.exception("batch %s failed", batch_id)
        message = f"internal error while running the batch: {type(exc).__name__}: {exc}"

        def fail(r: dict) -> dict:
            r["errors"] = {"object": "list", "data": [{"code": "internal_error", "line": None, "param": None,
                                                       "message": message}]}
            return set_status(r, "failed")

        return ctx.batches.update(batch_id, fail)
