"""A small batch of another tenant gets its first token within a few engine steps of arriving behind a
100,000-request batch: the real WorkQueue, a real EngineWorker (no Ray) and its engine, held at a gate.

The engine steps only when the test lets it, so the test counts steps and never times anything. Between
steps the test does what the dispatcher does: poll the worker, take what it wants from the queue, assign.
"""

from __future__ import annotations

import io
import json
import threading

import numpy as np

from bulkgen.engine.config import EngineConfig
from bulkgen.runtime.dispatch import take_for
from bulkgen.runtime.lineindex import LineIndex, index_file
from bulkgen.runtime.worker import EngineWorker
from bulkgen.runtime.workqueue import QueuedBatch, WorkQueue, make_ranges
from bulkgen.store import LocalStore
from tests.support.service import MODEL, completion_row, random_model

BIG = 100_000
BIG_MAX_TOKENS = [2, 3, 4, 5]  # so an engine slot frees within 5 steps
FEW_STEPS = 6  # one step to reach the engine, then the first slot that frees


class StepGate:
    """Holds the engine at the start of every step until `advance()`; notes each request's first token."""

    def __init__(self, engine) -> None:
        self.engine, self.real = engine, engine.step
        self.reached, self.allowed = threading.Semaphore(0), threading.Semaphore(0)
        self.steps = 0
        self.first_token: dict[str, int] = {}  # request id -> the step that gave it its first token
        engine.step = self._step

    def _step(self):
        self.reached.release()
        self.allowed.acquire()
        finished = self.real()
        self.steps += 1
        started = [out.request_id for out in finished]
        started += [
            rid for rid, r in self.engine.requests.items() if any(s.num_output_tokens for s in r.seqs)
        ]
        for rid in started:
            self.first_token.setdefault(rid, self.steps)
        return finished

    def first_of(self, batch_id: str, after: int = 0) -> int | None:
        """The first step after step `after` in which a request of `batch_id` got its first token."""
        steps = [s for rid, s in self.first_token.items() if rid.startswith(f"{batch_id}|") and s > after]
        return min(steps, default=None)

    def wait_at_gate(self) -> None:
        assert self.reached.acquire(timeout=120), "the engine never came back to the gate"

    def advance(self) -> None:
        """One step; returns when the engine waits at the gate again (its outputs are handled by then)."""
        self.allowed.release()
        self.wait_at_gate()


def _uniform_batch(store, batch_id: str, tenant: str, count: int, prompt: str, max_tokens: list[int]):
    """`count` requests in lines of equal length (max_tokens of one digit, in turn from `max_tokens`),
    indexed without scanning them all."""
    lines = [
        json.dumps(completion_row(f"{batch_id}-{i:06d}", prompt, max_tokens[i % len(max_tokens)])).encode()
        for i in range(count)
    ]
    assert len({len(line) for line in lines}) == 1
    key = f"files/data/{batch_id}"
    store.write_bytes(key, b"\n".join(lines) + b"\n")
    one = index_file(io.BytesIO(lines[0] + b"\n"), "/v1/completions")
    step = len(lines[0]) + 1
    index = LineIndex(
        np.arange(1, count + 1),
        np.arange(count) * step,
        np.full(count, len(lines[0])),  # lengths
        np.full(count, one.work[0]),
        np.full(count, one.prefix[0], dtype=np.uint64),
    )
    job = QueuedBatch(
        batch_id, key, "/v1/completions", MODEL, str(random_model()), 0.0, store.open_args(), tenant=tenant
    )
    return job, index


class Feeder:
    """What the dispatcher does while the engine steps: hand the worker what it asks for (`take_for`)."""

    def __init__(self, queue: WorkQueue, worker: EngineWorker) -> None:
        self.queue, self.worker = queue, worker
        self.inflight: set[tuple] = set()

    def feed(self) -> None:
        while True:
            poll = self.worker.poll("", 0)
            self.inflight -= {d.bounds.key for d in poll["done"]}
            ranges = take_for(self.queue, 0, poll, {key[0] for key in self.inflight})
            if not ranges:
                return
            self.inflight |= {r.key for r in ranges}
            self.worker.assign(ranges[0].batch, [r.bounds for r in ranges])


def test_a_small_batch_starts_within_a_few_steps_behind_a_huge_one(tmp_path):
    store = LocalStore(tmp_path)
    worker = EngineWorker(0, EngineConfig(max_num_seqs=8))
    worker.load(MODEL, str(random_model()))
    gate = StepGate(worker.engine)
    queue = WorkQueue(lambda _ranks: 1)
    big, big_index = _uniform_batch(store, "batch_big", "alpha", BIG, "hello " * 12, BIG_MAX_TOKENS)
    queue.add_batch(big, big_index, make_ranges(big, big_index, np.ones(BIG, bool), 16))
    feeder = Feeder(queue, worker)
    feeder.feed()
    gate.wait_at_gate()
    for _ in range(12):  # the big batch runs: every slot busy, a full engine load waiting
        gate.advance()
        feeder.feed()
    assert worker.engine.scheduler.num_waiting >= 8 and gate.first_of("batch_big") is not None

    # another tenant's 20 requests, each shorter than any of the big batch (longest first puts them last)
    small, small_index = _uniform_batch(store, "batch_small", "beta", 20, "hi", [2])
    queue.add_batch(small, small_index, make_ranges(small, small_index, np.ones(20, bool), 16))
    arrived = gate.steps
    while gate.first_of("batch_small") is None and gate.steps < arrived + 40:
        feeder.feed()
        gate.advance()
    first = gate.first_of("batch_small")
    assert first is not None, "the small batch got no token in 40 steps"
    assert first - arrived <= FEW_STEPS
    # it reached the engine during step `arrived + 1`: from the next step on, nothing of the big batch
    # started ahead of it
    big_since = gate.first_of("batch_big", after=arrived + 1)
    assert big_since is None or first <= big_since
    assert queue.pending_requests() > BIG - 200  # the big batch is still far from done
