"""The worker actor's class as plain Python: ranges in, parts out, a poison request isolated."""

from __future__ import annotations

import json
import time

import numpy as np

from bulkgen.batch.outputlines import json_line
from bulkgen.engine.config import EngineConfig
from bulkgen.runtime import parts
from bulkgen.runtime.lease import Lease, LeaseLost
from bulkgen.runtime.lineindex import index_file
from bulkgen.runtime.ranges import RangeBounds, RangeOutcome
from bulkgen.runtime.worker import EngineWorker
from bulkgen.runtime.workqueue import QueuedBatch, make_ranges
from bulkgen.store import LocalStore
from tests.support.clock import FakeClock
from tests.support.held_engine import HOLD
from tests.support.parts import merged, stored_entries
from tests.support.service import MODEL, completion_row, random_model
from tests.support.wait import wait_until


def _stored_batch(store, batch_id: str, rows: list[dict]) -> tuple[QueuedBatch, list[RangeBounds]]:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    key = f"files/data/{batch_id}-in"
    store.write_bytes(key, data)
    index = index_file(__import__("io").BytesIO(data), "/v1/completions")
    job = QueuedBatch(batch_id, key, "/v1/completions", MODEL, "unused", 0.0, store.open_args())
    return job, [r.bounds for r in make_ranges(job, index, np.ones(len(index), bool), 4)]


def _worker(store) -> EngineWorker:
    worker = EngineWorker(0, EngineConfig(max_num_seqs=8))
    worker.load(MODEL, str(random_model()))
    return worker


def _drain(worker: EngineWorker, ranges: int, timeout: float = 90) -> list[RangeOutcome]:
    done: list[RangeOutcome] = []
    deadline = time.monotonic() + timeout
    while len(done) < ranges and time.monotonic() < deadline:
        done += worker.poll("", 0.2)["done"]
    return done


def _lines(store, batch_id: str) -> dict[int, dict]:
    return stored_entries(store, batch_id)


def test_ranges_become_parts_with_one_entry_per_line(tmp_path):
    store = LocalStore(tmp_path)
    rows = [completion_row(f"r{i}", "hello " * (i + 1), max_tokens=3) for i in range(6)]
    rows.append(completion_row("too-long", "x", max_tokens=100_000))
    job, specs = _stored_batch(store, "batch_a", rows)
    worker = _worker(store)
    assert worker.poll("", 0)["want"] == 16  # two full batches of slots: one running, one to sort from
    worker.assign(job, specs)
    reports = _drain(worker, len(specs))
    assert sorted((r.bounds.lo, r.bounds.hi) for r in reports) == [(0, 4), (4, 7)]
    lines = _lines(store, "batch_a")
    assert sorted(lines) == list(range(1, 8))
    assert lines[7]["envelope"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert all(lines[i]["ok"] and lines[i]["usage"][1] == 3 for i in range(1, 7))
    assert sum(r.tally.completed for r in reports) == 6 and sum(len(r.requests) for r in reports) == 6
    steps = worker.poll("", 0)["steps"]
    assert set(steps) <= {"batch_a"}


def test_a_poison_request_is_isolated_and_costs_no_one_else(tmp_path):
    store = LocalStore(tmp_path)
    worker = _worker(store)
    engine = worker.engine
    real_step = engine.step

    def step_that_dies_on_poison():
        if "batch_p|3" in engine.requests:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step()

    engine.step = step_that_dies_on_poison
    job_p, specs_p = _stored_batch(
        store, "batch_p", [completion_row(f"p{i}", f"q {i}", max_tokens=4) for i in range(8)]
    )
    job_o, specs_o = _stored_batch(
        store, "batch_o", [completion_row(f"o{i}", f"z {i}", max_tokens=4) for i in range(4)]
    )
    worker.assign(job_p, specs_p)
    worker.assign(job_o, specs_o)
    _drain(worker, len(specs_p) + len(specs_o))
    poisoned = _lines(store, "batch_p")
    assert sorted(poisoned) == list(range(1, 9))
    bad = [e for e in poisoned.values() if not e["ok"]]
    assert [e["line"] for e in bad] == [3]
    assert bad[0]["envelope"]["response"]["body"]["error"]["code"] == "engine_error"
    assert "illegal memory access" in bad[0]["envelope"]["response"]["body"]["error"]["message"]
    other = _lines(store, "batch_o")
    assert sorted(other) == [1, 2, 3, 4] and all(e["ok"] for e in other.values())
    # the engine is healthy afterwards: a later batch runs normally
    job_l, specs_l = _stored_batch(store, "batch_l", [completion_row("l0", "later", max_tokens=2)])
    worker.assign(job_l, specs_l)
    _drain(worker, 1)
    assert _lines(store, "batch_l")[1]["ok"]


def test_abort_with_a_code_stores_what_finished_and_marks_the_rest(tmp_path, engine_gate):
    store = LocalStore(tmp_path)
    worker = _worker(store)
    rows = [completion_row(f"r{i}", f"{HOLD} long", max_tokens=64) for i in range(4)]
    job, specs = _stored_batch(store, "batch_c", rows)
    worker.assign(job, specs)
    engine_gate.wait_held()  # all four are in the engine, none can finish
    assert worker.abort_batch("batch_c", "batch_cancelled") == 1
    lines = _lines(store, "batch_c")
    assert sorted(lines) == [1, 2, 3, 4]
    assert all(e["envelope"]["error"]["code"] == "batch_cancelled" for e in lines.values())
    worker.assign(job, specs)  # a late assignment of a stopped batch is ignored: were it queued, the closed
    # gate would hold it in the engine and this wait would time out
    wait_until(
        lambda: worker.poll("", 0)["held"] == 0 and not worker.engine.has_unfinished(),
        30,
        "the worker to drop the aborted requests and hold nothing",
    )


def test_a_batch_cancelled_and_ended_while_its_range_is_prepared_never_reaches_the_engine(
    tmp_path, engine_gate
):
    """The runner cancels a batch (abort_batch) and, once it has ended, forgets it, while a range of it is
    still being read and tokenized (a range of 2,048-input embedding lines takes seconds): the preparation
    must still see the stop, and queue nothing. It found the stop mark dropped by forget() and queued the
    whole range, which the engine then ran for no batch."""
    import threading

    store = LocalStore(tmp_path)
    worker = _worker(store)
    rows = [completion_row(f"r{i}", f"{HOLD} long", max_tokens=64) for i in range(4)]
    job, specs = _stored_batch(store, "batch_p", rows)
    entered, release = threading.Event(), threading.Event()
    parse = worker._parse_lines  # the lines are read and tokenized before their range is held

    def slow_parse(*args):
        entered.set()
        release.wait(30)
        return parse(*args)

    worker._parse_lines = slow_parse
    assigning = threading.Thread(target=worker.assign, args=(job, specs[:1]))
    assigning.start()
    assert entered.wait(30)
    assert worker.abort_batch("batch_p", "batch_cancelled") == 0  # nothing of it is held yet
    worker.forget("batch_p")  # the batch ended
    release.set()
    assigning.join(30)
    # were its lines queued, the closed gate would hold them in the engine
    assert worker.poll("", 0)["held"] == 0 and not worker.engine.has_unfinished()
    assert "batch_p" not in worker._stopped  # the mark goes once the preparation is over


def test_leases_exclude_a_second_owner_until_they_lapse(tmp_path):
    store = LocalStore(tmp_path)
    clock = FakeClock()
    a = Lease(store, "batch_x", "replica-a", ttl_s=30, clock=clock)
    b = Lease(store, "batch_x", "replica-b", ttl_s=30, clock=clock)
    assert a.acquire() and not b.acquire()
    a.renew()
    clock.advance(29)
    assert not b.acquire()  # still a's: its renewal restarted the 30 s
    clock.advance(2)
    assert b.acquire()  # a's lease lapsed (its process stopped renewing)
    try:
        a.renew()
        raise AssertionError("a stale owner renewed a lease it lost")
    except LeaseLost:
        pass
    b.release()
    assert a.acquire()


def test_merge_keeps_one_line_per_request_in_input_order(tmp_path):
    store = LocalStore(tmp_path)

    def e(line: int, tag: str) -> parts.PartEntry:
        return parts.PartEntry.of(line, True, {"custom_id": f"c{line}", "tag": tag}, (1, 1, 0))

    parts.write_part(store, "b", 5, 8, [e(5, "x"), e(8, "x")])
    parts.write_part(store, "b", 1, 4, [e(1, "x"), e(2, "x"), e(4, "x")])
    parts.write_part(store, "b", 1, 2, [e(1, "retry"), e(2, "retry")])  # a retried half: a duplicate
    out, err, tally = merged(store, "b")
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["custom_id"] for x in lines] == ["c1", "c2", "c4", "c5", "c8"]
    assert tally.completed == 5 and tally.input_tokens == 5 and err == b""


def test_a_part_keeps_each_output_line_as_encoded_and_the_merge_copies_it(tmp_path):
    store = LocalStore(tmp_path)
    envelope = {"custom_id": 'a\u2028,"envelope":', "response": {"body": {"text": 'é\t"}'}}, "error": None}
    entry = parts.PartEntry.of(7, True, envelope, (3, 2, 1))
    assert parts.PartEntry.decode(entry.encode()) == entry
    assert json.loads(entry.encode()) == {"line": 7, "ok": True, "usage": [3, 2, 1], "envelope": envelope}
    parts.write_part(store, "b", 7, 7, [entry])
    out, err, tally = merged(store, "b")
    assert out == json_line(envelope) and err == b""
    assert (tally.completed, tally.input_tokens, tally.output_tokens, tally.cached_tokens) == (1, 3, 2, 1)


def test_progress_counts_requests_of_ranges_not_yet_written(tmp_path, engine_gate):
    store = LocalStore(tmp_path)
    worker = _worker(store)
    rows = [completion_row("quick", "a", max_tokens=1)] + [
        completion_row(f"slow{i}", f"{HOLD} b", max_tokens=64) for i in range(3)
    ]
    job, specs = _stored_batch(store, "batch_g", rows)
    worker.assign(job, specs, owner="me")
    deadline = time.monotonic() + 60
    progress = {}
    while time.monotonic() < deadline and not progress:
        progress = worker.poll("me", 0.2)["progress"]
    assert progress == {"batch_g": {"completed": 1, "failed": 0}}
    assert worker.poll("someone-else", 0)["progress"] == {}
    worker.abort_batch("batch_g", None)


def test_the_worker_reports_its_engine_step_time_over_every_step_it_ran(tmp_path):
    store = LocalStore(tmp_path)
    worker = _worker(store)
    assert worker.poll("", 0)["step_time"] == {"steps": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None}
    rows = [completion_row(f"s{i}", "step " * (i + 1), max_tokens=3) for i in range(6)]
    job, specs = _stored_batch(store, "batch_s", rows)
    worker.assign(job, specs)
    done, records = 0, 0
    deadline = time.monotonic() + 90
    while done < len(specs) and time.monotonic() < deadline:
        poll = worker.poll("", 0.2)
        done += len(poll["done"])
        records += len(poll["steps"].get("batch_s", []))
    last = worker.poll("", 0)
    records += len(last["steps"].get("batch_s", []))
    step_time = last["step_time"]
    assert step_time["steps"] == worker.engine.stats_.counters["steps"] == records > 0
    assert step_time["mean_ms"] > 0 and 0 < step_time["p50_ms"] <= step_time["p90_ms"]


def test_the_worker_builds_every_engine_from_its_typed_config():
    """The engine a worker loads and the one it rebuilds after a failed reset both take the worker's
    EngineConfig, not a dict filtered on the way."""
    worker = EngineWorker(0, EngineConfig(max_num_seqs=3, block_size=8))
    worker.load(MODEL, str(random_model()))
    first = worker.engine
    assert (first.config.max_num_seqs, first.config.block_size) == (3, 8)

    def broken():
        raise RuntimeError("reset failed")

    first.reset = broken
    worker._on_engine_thread(worker._reset_engine)
    rebuilt = worker.engine
    assert rebuilt is not first and rebuilt.model is first.model
    assert (rebuilt.config.max_num_seqs, rebuilt.config.block_size) == (3, 8)
