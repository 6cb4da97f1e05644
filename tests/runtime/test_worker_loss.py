"""What the dispatcher does when a worker is lost, on the real work queue (no Ray, no engine): the lost
worker's live counts are withdrawn, its replacement is retried for as long as it takes, and the new
actor loads the lost one's model at once."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from bulkgen.runtime import dispatch
from bulkgen.runtime.dispatch import Dispatcher
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.runtime.workqueue import QueuedBatch, WorkQueue, make_ranges
from bulkgen.settings import WorkerSettings


class _Remote:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append((self.name, args))


class _Handle:
    """An actor handle's surface the dispatcher uses after a replacement: `load.remote`."""

    def __init__(self) -> None:
        self.calls: list = []
        self.load = _Remote(self.calls, "load")


class _Pool:
    """The pool's surface: its workers, its settings, and `replace`, which fails `failures` times first
    (no resources yet, the dead actor's name still taken)."""

    def __init__(self, failures: int) -> None:
        self.workers = [_Handle(), _Handle()]
        self.ranks = [1, 1]
        self.settings = WorkerSettings()
        self.use_gpu = False
        self.failures, self.attempts = failures, 0

    def replace(self, index: int):
        self.attempts += 1
        if self.attempts <= self.failures:
            raise RuntimeError("could not replace bulkgen-worker-0")
        self.workers[index] = _Handle()
        return self.workers[index]


class _Runner:
    def __init__(self, batch_id: str) -> None:
        self.batch_id = batch_id
        self.live: dict[str, dict] = {}
        self.given_up: list = []

    def live_progress(self, worker: str, counts: dict | None) -> None:
        self.live[worker] = counts or {}

    def give_up(self, r, reason: str) -> None:
        self.given_up.append(r)


def _dispatcher(pool: _Pool, runner: _Runner) -> tuple[Dispatcher, WorkQueue]:
    queue = WorkQueue(lambda _ranks: len(pool.workers))
    d = Dispatcher(pool, queue, None, lambda b: runner if b == runner.batch_id else None, "me")
    d.inflight = [{} for _ in pool.workers]
    d.models_loaded = ["tiny@/models/tiny", "tiny@/models/tiny"]
    d._model_of = [("tiny", "/models/tiny"), ("tiny", "/models/tiny")]
    d.nodes = ["10.0.0.2", "10.0.0.3"]
    d._had_work = [True, True]
    d._ready, d._alive_at, d._loading = [True, True], [0.0, 0.0], [None, None]
    d._answered = [True, True]
    return d, queue


def _ranges(queue: WorkQueue, batch_id: str, n: int = 64):
    index = LineIndex(
        np.arange(1, n + 1),
        np.arange(n) * 10,
        np.full(n, 9),  # lengths
        np.ones(n, dtype=np.int64),
        np.zeros(n, dtype=np.uint64),
    )
    job = QueuedBatch(batch_id, f"files/data/{batch_id}", "/v1/completions", "tiny", "/models/tiny", 0.0, {})
    queue.add_batch(job, index, make_ranges(job, index, np.ones(n, bool), 16))
    return queue.take(0, 32, job.model_key, idle=True)


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch):
    monkeypatch.setattr(dispatch, "REPLACE_BACKOFF_S", (0.001, 0.002))


def test_a_lost_workers_live_counts_are_withdrawn_so_counts_never_exceed_the_total():
    pool, runner = _Pool(failures=0), _Runner("b1")
    d, queue = _dispatcher(pool, runner)
    taken = _ranges(queue, "b1")
    d.inflight[0] = {r.key: r for r in taken}
    runner.live_progress("bulkgen-worker-0", {"completed": 20, "failed": 0})  # settled, not yet written
    d._lost(0, TimeoutError("poll unanswered"))
    assert runner.live["bulkgen-worker-0"] == {}  # redone elsewhere: counted once, there
    assert queue.pending_requests() == 64  # every lost request is queued again
    assert d.inflight[0] == {} and runner.given_up == []


def test_replacement_is_retried_until_it_succeeds_and_the_new_worker_loads_the_model_at_once():
    pool, runner = _Pool(failures=3), _Runner("b1")
    d, _ = _dispatcher(pool, runner)
    d._lost(0, TimeoutError("poll unanswered"))
    assert pool.attempts == 4  # three failures did not end the dispatcher's thread
    assert pool.workers[0].calls == [("load", ("tiny", "/models/tiny", None))]
    assert d.nodes[0] is None  # the new actor's node is learnt from its first poll


def test_a_stopped_dispatcher_gives_up_replacing():
    pool, runner = _Pool(failures=10**9), _Runner("b1")
    d, _ = _dispatcher(pool, runner)
    d.stop()
    d._lost(0, TimeoutError("poll unanswered"))
    assert pool.attempts == 0


def test_ranges_of_a_worker_that_keeps_dying_while_it_loads_are_given_up_not_dropped(monkeypatch):
    """A tensor-parallel group whose follower dies in every load (rank 0 exits: groups.FollowerWatch): each
    load's ranges go back one attempt older, are halved, and a lone request is given up on after
    MAX_ATTEMPTS with a reason; before, the ranges given up on by that put_back were dropped, and their
    lines never ended."""
    pool, runner = _Pool(failures=0), _Runner("b1")
    d, queue = _dispatcher(pool, runner)

    def dies(*_args, **_kwargs):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(dispatch.ray, "get", dies)
    taken = _ranges(queue, "b1")
    for _ in range(1000):
        if not taken:
            break
        with pytest.raises(ray.exceptions.RayActorError):
            d._load(0, pool.workers[0], taken)
        taken = queue.take(0, 32, "tiny@/models/tiny", idle=True)
    assert queue.pending_requests() == 0
    assert sorted(line for r in runner.given_up for line in range(r.bounds.lo, r.bounds.hi)) == list(
        range(64)
    )
