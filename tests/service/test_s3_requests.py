"""S3 requests follow the work, not the clock (bulkgen.runtime.pacing): every request the service and its
workers send to the S3 endpoint is counted by a real HTTP proxy in front of moto (tests/support/s3.py).

- A batch of LINES lines, held near its end for HELD_S (a slowed batch: its time grows, its lines do
  not), stays within the request budget per 1,000 lines over a batch's fixed cost (a one-line batch's,
  measured in the same run, plus the PUBLISH_STEPS progress writes a batch makes by its share of lines,
  which a one-line batch does not: 4 PUT-class per 1,000 lines at 4,000 lines, 1.2 at 10,000), lease
  renewals apart (one per ttl/3 of its run: they say its runner lives);
  while it is held the runtime sends only a few requests (renewals and a rare look at the record), not
  a record and report write every 2 s.
- An idle service (API and runtime, nothing to run) lists the active batches at most IDLE_LISTS times in
  IDLE_S: a back-off that doubles from its first interval (2 s by default, SCAN_EVERY_S here, so the test
  waits a quarter of the minute the default takes) to a minute, not a listing every first interval.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections import Counter

import pytest

from bulkgen.batch.service import BatchService
from bulkgen.runtime.driver import Driver
from bulkgen.runtime.manager import BatchManager
from bulkgen.runtime.pacing import PUBLISH_STEPS
from tests.support.held_engine import GATE_ENV, HOLD, EngineGate
from tests.support.s3 import tally
from tests.support.service import Service, completion_row, settings_for
from tests.support.wait import wait_until

LINES = 4_000  # this machine runs ~100 lines/s through the runtime: 10k lines would outlast the test's time
HELD_S = 20.0
RANGE = 32  # lines per range and part (the default)
PUT_CLASS_PER_1000 = 40  # PUT, POST, COPY and LIST: S3's dearer request class
PER_BATCH_WRITES = PUBLISH_STEPS + 2  # its progress writes (by share of its lines) and their metrics state
GET_CLASS_PER_1000 = 80  # GET and HEAD
HELD_REQUESTS = 12  # in HELD_S, leases included: the old runtime sent ~60 (record, report, control, listing)
SCAN_EVERY_S = 0.5  # the manager's first listing interval (Settings.scan_every_s; 2 s by default)
IDLE_S = 30 * SCAN_EVERY_S  # a listing every first interval would be 30 listings
IDLE_LISTS = 6  # listings at 0, 0.5, 1.5, 3.5, 7.5 and 15.5 s (at the default: 0, 2, 6, 14, 30 and 62 s)


def batch_lines(count: int, held: bool) -> bytes:
    """`count` short completion lines; with `held`, the last one waits at the engine gate."""
    rows = [completion_row(f"r{i}", f"p {i % 97}", max_tokens=1) for i in range(count)]
    if held:  # more tokens than the whole batch takes steps (tests/support/held_engine.py)
        rows[-1] = completion_row("held", f"{HOLD} the last line", max_tokens=400)
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def counted_svc(s3_bucket_url, flaky_proxy):
    """A BatchService whose storage, and its workers', is the bucket behind the counting proxy."""
    settings = settings_for(s3_bucket_url, endpoint_url=flaky_proxy.url)
    settings.range_size = RANGE  # the default
    return BatchService(settings)


def run_batch(driver: Driver, data: bytes, while_held=None):
    """Store, create and run one batch to its end through the runtime here; `while_held()` runs while its
    held line waits at the gate, which then opens."""
    record = driver.accept(driver.store(io.BytesIO(data), "b.jsonl"), "/v1/completions", "24h")
    driver.manager.wake()
    if while_held is not None:
        gate = EngineGate(os.environ[GATE_ENV])
        gate.wait_held(timeout=200)
        runner = driver.manager.runner_of(record.id)
        held_range = (len(data.splitlines()) - 1) % RANGE + 1  # the lines of the last range, the held one's
        wait_until(lambda: (~runner.done).sum() == held_range, 200, "every range but the held one")
        while_held()
        gate.open()
    return driver.manager.wait(record.id)


def test_slowed_batch_stays_within_the_budget_per_1000_lines(counted_svc, flaky_proxy, engine_gate):
    """Per 1,000 lines over a batch's fixed cost, measured in the same run with a one-line batch: the
    requests that grow with a batch, however long it is held."""
    manager = BatchManager(counted_svc)
    manager.start()
    held: Counter = Counter()
    began = time.monotonic()

    def hold() -> None:
        start = len(flaky_proxy.log)
        time.sleep(HELD_S)  # the batch is slowed: wall time passes while no line settles
        held.update(tally(flaky_proxy.log[start:]))

    try:
        driver = Driver(counted_svc, manager)
        engine_gate.open()
        assert run_batch(driver, batch_lines(1, held=False)).status == "completed"
        fixed = tally(flaky_proxy.log)
        engine_gate.close()
        record = run_batch(driver, batch_lines(LINES, held=True), hold)
    finally:
        manager.stop(kill_workers=False)
    assert record.status == "completed", record.errors
    assert record.request_counts.completed == LINES
    # a renewal per ttl/3 of the test, and per batch its lease taken and released (a read and a write each)
    renewals_allowed = (time.monotonic() - began) / (counted_svc.settings.lease_ttl_s / 3) + 1 + 2 * 4
    grown = tally(flaky_proxy.log)
    grown.subtract(fixed)
    per_1000 = {k: round(v * 1000 / LINES, 1) for k, v in grown.items()}
    print(f"\nper 1,000 lines: {per_1000}; a one-line batch: {dict(fixed)}; {HELD_S:g} s held: {dict(held)}")
    assert sum(held.values()) <= HELD_REQUESTS, held
    assert grown["lease"] <= renewals_allowed, (grown, renewals_allowed)
    assert grown["put"] + grown["list"] <= PUT_CLASS_PER_1000 * LINES / 1000 + PER_BATCH_WRITES, per_1000
    assert grown["get"] * 1000 / LINES <= GET_CLASS_PER_1000, per_1000


def test_idle_service_lists_with_back_off(s3_bucket_url, flaky_proxy):
    service = Service(settings_for(s3_bucket_url, endpoint_url=flaky_proxy.url, scan_every_s=SCAN_EVERY_S))
    try:
        wait_until(lambda: tally(flaky_proxy.log)["list"], 30, "the manager's first listing")
        start, began = len(flaky_proxy.log), time.monotonic()
        time.sleep(IDLE_S)  # idle: what is measured is what the service does on its own over this time
        idle = tally(flaky_proxy.log[start:])
        client = service.client()  # a batch created here is seen at once, back-off or not
        file_id = client.files.create(
            file=("a.jsonl", json.dumps(completion_row("a", "hi", max_tokens=1)).encode()), purpose="batch"
        ).id
        lists_before = tally(flaky_proxy.log)["list"]
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        wait_until(
            lambda: client.batches.retrieve(batch.id).status == "completed", 60, "the batch to complete"
        )
    finally:
        service.stop()
    print(f"\nidle {time.monotonic() - began:.0f} s: {dict(idle)}")
    assert 1 <= idle["list"] <= IDLE_LISTS, idle
    assert idle["put"] == idle["get"] == 0, idle
    assert tally(flaky_proxy.log)["list"] > lists_before
