"""Workers whose driver is gone (a head that died) store nothing more, and a runner that takes a batch over
from another owner finalizes only once that owner's workers can store nothing: the parts of the
engine class as plain Python and the lease, without Ray (the live case: test_netns_cluster.py)."""

from __future__ import annotations

import time

import pytest

from bulkgen.runtime import lease as lease_module
from bulkgen.runtime import part_writer as writer_module
from bulkgen.runtime import parts
from bulkgen.runtime.lease import Lease, LeaseLost
from bulkgen.store import LocalStore
from tests.runtime.test_worker import _stored_batch, _worker
from tests.support.clock import FakeClock
from tests.support.service import completion_row


def test_a_worker_stores_no_part_for_a_driver_that_stopped_polling(tmp_path):
    store = LocalStore(tmp_path)
    worker = _worker(store)
    worker.clock = clock = FakeClock()
    rows = [completion_row(f"r{i}", "hello " * (i + 1), max_tokens=3) for i in range(4)]
    job, specs = _stored_batch(store, "batch_orphan", rows)
    worker.poll("gone", 0)  # a driver's last poll; then it dies (its head did) and never polls again
    clock.advance(
        writer_module.ORPHAN_AFTER_S
    )  # its range finishes after the driver has been silent that long
    worker.assign(job, specs, owner="gone")
    live_job, live_specs = _stored_batch(store, "batch_live", rows)
    worker.assign(live_job, live_specs, owner="alive")
    done: list = []
    deadline = time.monotonic() + 60
    while not done and time.monotonic() < deadline:
        done = worker.poll("alive", 0.2)["done"]  # a live driver: its range is stored as usual
    assert done and done[0].error is None and parts.iter_parts(store, "batch_live")
    while worker.poll("alive", 0.2)["held"] and time.monotonic() < deadline:
        pass
    worker._writes.join()  # the writer has dealt with every finished range
    assert parts.iter_parts(store, "batch_orphan") == []  # nothing stored for the silent driver
    handed_back = worker.poll("gone", 0)["done"]  # were it only slow, it gets its range back to redo
    assert [(r.bounds.lo, r.bounds.hi, r.storage_down) for r in handed_back] == [(0, 4, True)]


def test_a_runner_taking_a_batch_over_waits_until_the_old_owners_workers_stopped(tmp_path):
    clock = FakeClock()
    store = LocalStore(tmp_path)
    dead = Lease(store, "batch_t", "replica-dead", ttl_s=20, clock=clock)
    assert dead.acquire() and dead.orphans_done_at() == 0.0  # a fresh batch: nobody to wait for
    lapsed_at = dead.body["expires_at"]
    heir = Lease(store, "batch_t", "replica-heir", ttl_s=30, clock=clock, sleep=clock.advance)
    assert not heir.acquire()  # the dead owner's lease has not lapsed yet
    clock.advance(20.5)
    assert heir.acquire()
    done_at = lapsed_at + lease_module.ORPHAN_AFTER_S + lease_module.PART_WRITE_S
    assert heir.orphans_done_at() == pytest.approx(done_at)
    checks: list[float] = []
    heir.wait_for_orphans(lambda: checks.append(clock()))
    assert clock() >= done_at and len(checks) >= lease_module.ORPHAN_AFTER_S  # a check each second
    again = Lease(store, "batch_t", "replica-heir", ttl_s=30, clock=clock)
    assert again.acquire() and again.orphans_done_at() == 0.0  # our own lease: no one else's workers

    def lost() -> None:
        raise LeaseLost("batch_t")

    other = Lease(store, "batch_u", "x", ttl_s=1, clock=clock)
    other.acquire()
    clock.advance(2)
    late = Lease(store, "batch_u", "y", ttl_s=30, clock=clock, sleep=clock.advance)
    assert late.acquire()
    with pytest.raises(LeaseLost):
        late.wait_for_orphans(lost)
