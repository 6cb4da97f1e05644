"""The work queue and the line index on hand-made inputs (no Ray, no engine)."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np

from bulkgen.runtime.lineindex import LineIndex, index_file, read_lines
from bulkgen.runtime.workqueue import MAX_ATTEMPTS, QueuedBatch, QueuedRange, WorkQueue, make_ranges
from bulkgen.store import LocalStore
from tests.support.clock import FakeClock


def _index(work: list[int], prefix: list[int] | None = None) -> LineIndex:
    n = len(work)
    return LineIndex(
        np.arange(1, n + 1),
        np.arange(n) * 10,
        np.full(n, 9),  # lengths: each line ends 9 bytes after its start
        np.array(work),
        np.array(prefix or [0] * n, dtype=np.uint64),
    )


def _job(batch_id: str, order: float, model: str = "m") -> QueuedBatch:
    return QueuedBatch(
        batch_id, f"files/data/{batch_id}", "/v1/completions", model, "p", order, {"url": "unused"}
    )


def _spans(ranges: list[QueuedRange]) -> list[tuple[int, int]]:
    return [(r.bounds.lo, r.bounds.hi) for r in ranges]


def _queue(workers: int = 1, fair_after: float = 30.0) -> WorkQueue:
    return WorkQueue(lambda _ranks: workers, fair_after)


def _add(q: WorkQueue, job: QueuedBatch, index: LineIndex, size: int) -> None:
    q.add_batch(job, index, make_ranges(job, index, np.ones(len(index), bool), size))


def test_ranges_skip_done_lines_and_longest_work_goes_first():
    index = _index([1, 1, 9, 9, 5, 5])
    job = _job("b", 0)
    done = np.array([False, False, False, False, True, False])
    ranges = make_ranges(job, index, ~done, 2)
    assert _spans(ranges) == [(0, 2), (2, 4), (5, 6)]
    q = _queue()
    q.add_batch(job, index, ranges)
    assert _spans(q.take(0, 2, "m@p", idle=False)) == [(2, 4)]  # work 9 per request
    assert _spans(q.take(0, 1, "m@p", idle=False)) == [(5, 6)]
    assert _spans(q.take(0, 1, "m@p", idle=False)) == [(0, 2)]  # whole ranges, not the tail
    assert q.take(0, 1, "m@p", idle=False) == []


def test_fifo_then_deadline_and_no_starvation():
    clock = FakeClock()
    q = WorkQueue(lambda _ranks: 1, fair_share_after_s=30.0, clock=clock)
    _add(q, _job("old-big", order=1.0), _index([1] * 100), 10)
    _add(q, _job("new-small", order=2.0), _index([1] * 5), 10)
    assert q.take(0, 10, "m@p", idle=False)[0].batch.batch_id == "old-big"
    clock.advance(29)
    assert q.take(0, 10, "m@p", idle=False)[0].batch.batch_id == "old-big"
    clock.advance(2)  # new-small got nothing for longer than fair_share_after_s: it goes next
    assert q.take(0, 10, "m@p", idle=False)[0].batch.batch_id == "new-small"
    assert q.take(0, 10, "m@p", idle=False)[0].batch.batch_id == "old-big"


def test_a_worker_keeps_its_model_unless_idle():
    q = _queue()
    _add(q, _job("a", 1.0, model="other"), _index([1] * 4), 4)
    assert q.take(0, 4, "m@p", idle=False) == []
    assert q.take(0, 4, "m@p", idle=True)[0].batch.model == "other"


def test_a_worker_takes_only_models_of_its_rank_count_even_a_starving_one():
    clock = FakeClock()
    workers = {1: 3, 2: 1}  # three single workers, one group of two ranks
    q = WorkQueue(lambda ranks: workers[ranks], fair_share_after_s=30.0, clock=clock)
    big = dataclasses.replace(_job("big", 1.0, model="big"), ranks=2)
    _add(q, big, _index([1] * 8), 8)
    _add(q, _job("small", 2.0, model="small"), _index([1] * 6), 6)
    clock.advance(60)  # both starve: the rule that serves a starving batch first stays within the class
    # at the tail each class's work is split among that class's workers: 6 requests over 3 single workers
    # take 2 each (all 14 queued over them would be 5), and what is left is split again
    taken = [q.take(w % 3, 8, None, idle=True, ranks=1) for w in range(4)]
    assert [(r.batch.batch_id, r.size) for t in taken for r in t] == [("small", 2), ("small", 2)] + [
        ("small", 1)
    ] * 2
    assert q.take(0, 8, None, idle=True, ranks=1) == []  # "big" waits for its group, however long
    assert q.take(4, 8, None, idle=True, ranks=4) == []
    assert _spans(q.take(3, 8, None, idle=True, ranks=2)) == [(0, 8)]  # the one group takes all of "big"


def test_the_tail_is_split_among_workers():
    q = _queue(workers=4)
    _add(q, _job("b", 0), _index([1] * 8), 8)
    got = q.take(0, 100, "m@p", idle=False)
    assert sum(r.size for r in got) == 2  # 8 pending over 4 workers
    assert q.pending_requests() == 6


def test_lost_ranges_come_back_halved_and_a_lone_killer_is_given_up():
    q = _queue()
    _add(q, _job("b", 0), _index([1] * 4), 4)
    [r] = q.take(0, 4, "m@p", idle=False)
    assert q.put_back([r]) == [] and q.pending_requests() == 4  # attempt 1: the same range again
    [r] = q.take(0, 4, "m@p", idle=False)
    assert q.put_back([r]) == []  # attempt 2: halved
    halves = q.take(0, 2, "m@p", idle=False) + q.take(0, 2, "m@p", idle=False)
    assert sorted(h.size for h in halves) == [2, 2]
    suspect = halves[0]
    for _ in range(MAX_ATTEMPTS):
        q.put_back([suspect])
        taken = q.take(0, 1, "m@p", idle=False)
        if not taken:
            break
        suspect = taken[0]
    single = suspect
    assert single.size == 1
    given_up = []
    while not given_up:
        given_up = q.put_back([single])
        single = (q.take(0, 1, "m@p", idle=False) or [single])[0]
    assert given_up[0].size == 1 and given_up[0].attempts + 1 >= MAX_ATTEMPTS


def test_shared_prefixes_stay_on_the_worker_that_cached_them():
    q = _queue(workers=2)
    _add(q, _job("b", 0), _index([5] * 40, prefix=[7] * 20 + [9] * 20), 5)
    first = {w: q.take(w, 5, "m@p", idle=False)[0].prefix for w in (0, 1)}
    assert first[0] != first[1]
    for _ in range(3):
        for w in (0, 1):
            assert q.take(w, 5, "m@p", idle=False)[0].prefix == first[w]


def test_scan_indexes_offsets_across_blank_and_crlf_lines(tmp_path):
    rows = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "x" * (4 * i + 4), "max_tokens": 3},
        }
        for i in range(3)
    ]
    data = (json.dumps(rows[0]) + "\r\n\n" + json.dumps(rows[1]) + "\n   \n" + json.dumps(rows[2])).encode()
    index = index_file(io.BytesIO(data), "/v1/completions")
    assert index.lines.tolist() == [1, 3, 5]
    assert index.work.tolist() == [1 + 3, 2 + 3, 3 + 3]
    store = LocalStore(tmp_path)
    store.write_bytes("in.jsonl", data)
    got = list(read_lines(store, "in.jsonl", 3, int(index.starts[1]), int(index.ends[2])))
    assert [(n, json.loads(raw)["custom_id"]) for n, raw in got] == [(3, "r1"), (5, "r2")]
    assert index.positions(2, 5) == (1, 3)


def _counted_sizes(monkeypatch) -> list[int]:
    """Count reads of `QueuedRange.size`: any pass over every queued range (a sum, a sort) reads it once
    per range, so the count per call is the queue's work per call, whatever the machine's speed."""
    reads = [0]
    plain = QueuedRange.size.fget

    def size(self):
        reads[0] += 1
        return plain(self)

    monkeypatch.setattr(QueuedRange, "size", property(size))
    return reads


def _work_per_call(monkeypatch, lines: int, calls: int = 50) -> float:
    q = _queue(workers=4)
    job = _job("big", 0)
    index = _index(list(np.arange(lines) % 97 + 1), prefix=list(np.arange(lines) % 1000 + 1))
    _add(q, job, index, 32)
    reads = _counted_sizes(monkeypatch)
    for i in range(calls):  # a take, and a lost range put back (re-queued in order), per round
        taken = q.take(i % 4, 64, "m@p", idle=False)
        q.put_back(taken[:1], count=False)
        q.pending_requests()
    monkeypatch.undo()
    return reads[0] / calls


def test_queue_work_per_call_does_not_grow_with_what_is_queued(monkeypatch):
    """take / put_back / pending_requests at 3,200 and 320,000 queued lines: the same work per call (the
    old queue summed and re-sorted every pending range: 100x more reads at 100x the lines)."""
    small = _work_per_call(monkeypatch, 3_200)
    big = _work_per_call(monkeypatch, 320_000)
    assert big <= small + 4 and big < 50, (small, big)


def test_the_affinity_map_is_bounded(monkeypatch):
    import bulkgen.runtime.workqueue as workqueue

    monkeypatch.setattr(workqueue, "AFFINITY_ENTRIES", 100, raising=False)
    q = _queue(workers=1)
    _add(q, _job("b", 0), _index([1] * 1000, prefix=list(range(1, 1001))), 1)
    last = None
    while taken := q.take(0, 10, "m@p", idle=False):
        last = taken[-1]
    assert len(q._affinity) <= 100
    assert q._affinity[last.prefix] == 0  # the most recent are the ones kept


def _choice_work_per_call(monkeypatch, batches: int, calls: int = 200) -> float:
    clock = FakeClock()
    q = WorkQueue(lambda _ranks: 4, fair_share_after_s=30.0, clock=clock)
    index = _index([1] * 64)
    for b in range(batches):
        job = dataclasses.replace(_job(f"b{b}", float(b)), tenant=f"t{b % 3}")
        _add(q, job, index, 8)
    reads, plain = [0], QueuedBatch.model_key.fget

    def model_key(self):
        reads[0] += 1
        return plain(self)

    monkeypatch.setattr(QueuedBatch, "model_key", property(model_key))
    for i in range(calls):  # takes on a worker's model and idle ones, starving batches, put-backs
        clock.advance(1)
        taken = q.take(i % 4, 8, "m@p", idle=i % 2 == 0, exclude={"b0", "b1"})
        q.put_back(taken, count=False)
    monkeypatch.undo()
    return reads[0] / calls


def test_choosing_a_batch_does_not_grow_with_the_batches_queued(monkeypatch):
    """20 and 2,000 batches queued (10M lines are 200 batches at the default --max-requests-per-batch):
    choosing the next batch reads about as many batches either way (the old queue read every batch's
    model at every take: 100x more at 100x the batches)."""
    small = _choice_work_per_call(monkeypatch, 20)
    big = _choice_work_per_call(monkeypatch, 2_000)
    assert big <= 2 * small + 8 and big < 40, (small, big)
