"""A worker whose poll waits for results alone (it had room, the queue had nothing) gets ranges queued
meanwhile at once, not when its poll answers: on the real work queue, without Ray (the poll's answer is
a plain Future the test completes or not)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from bulkgen.runtime.dispatch import Dispatcher
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.runtime.workqueue import QueuedBatch, WorkQueue, make_ranges
from bulkgen.settings import WorkerSettings

MODEL_KEY = "tiny@/models/tiny"


class _Handle:
    """An actor handle's surface `_hand` uses: `assign.remote`, recorded."""

    def __init__(self) -> None:
        self.assigned: list[list] = []
        handle = self

        class _Assign:
            def remote(self, batch, bounds, owner):
                handle.assigned.append(bounds)

        self.assign = _Assign()


class _Pool:
    def __init__(self) -> None:
        self.workers = [_Handle()]
        self.ranks = [1]
        self.settings = WorkerSettings()
        self.use_gpu = False


def _dispatcher() -> tuple[Dispatcher, WorkQueue, _Handle]:
    pool = _Pool()
    queue = WorkQueue(lambda _ranks: 1)
    d = Dispatcher(pool, queue, None, lambda b: None, "me")
    d.inflight, d.models_loaded, d._had_work = [{}], [MODEL_KEY], [False]
    d._news = [threading.Event()]
    queue.on_work(d._work_queued)
    # its last answer: room for 32 requests, nothing queued then
    d._last_poll = {0: {"want": 32, "spare": 0, "held": 0, "model": MODEL_KEY}}
    return d, queue, pool.workers[0]


def _add_batch(queue: WorkQueue, batch_id: str, n: int = 64) -> None:
    index = LineIndex(
        np.arange(1, n + 1),
        np.arange(n) * 10,
        np.full(n, 9),  # lengths
        np.ones(n, dtype=np.int64),
        np.zeros(n, dtype=np.uint64),
    )
    batch = QueuedBatch(
        batch_id, f"files/data/{batch_id}", "/v1/completions", "tiny", "/models/tiny", 0.0, {}
    )
    queue.add_batch(batch, index, make_ranges(batch, index, np.ones(n, bool), 16))


def test_ranges_queued_while_an_idle_workers_poll_waits_go_to_it_before_the_poll_answers():
    d, queue, handle = _dispatcher()
    answered: Future = Future()  # the poll never answers during the test
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(d._hand_while_polling(0, handle, answered)))
    waiter.start()
    _add_batch(queue, "b1")
    waiter.join(30)
    assert got == [True] and not answered.done()
    assert sum(b.size for b in handle.assigned[0]) == 32  # the room its last answer reported
    assert queue.pending_requests() == 32 and len(d.inflight[0]) == 2


def test_a_poll_that_answers_first_ends_the_wait_with_nothing_handed_out():
    d, queue, handle = _dispatcher()
    answered: Future = Future()
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(d._hand_while_polling(0, handle, answered)))
    waiter.start()
    answered.set_result({"want": 32})
    waiter.join(30)
    assert got == [False] and handle.assigned == []
