"""Fair share between tenants and priorities between batches, simulated against the real WorkQueue.

No Ray and no engine: a step counter stands in for time. Each simulated worker holds up to two engine
loads of requests, runs `SLOTS` of them at once and generates one token per running request per step;
a range that finishes is settled with the tokens it really used, as the dispatcher does.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np

from bulkgen.runtime.lineindex import LineIndex
from bulkgen.runtime.workqueue import QueuedBatch, WorkQueue, make_ranges

SLOTS = 8
MAX_TOKENS = 32


def _index(n: int, rng: random.Random) -> LineIndex:
    work = [rng.randint(4, 24) + MAX_TOKENS for _ in range(n)]  # prompt estimate + max_tokens
    return LineIndex(
        np.arange(1, n + 1),
        np.arange(n) * 10,
        np.full(n, 9),  # lengths
        np.array(work),
        np.zeros(n, dtype=np.uint64),
    )


def _add(
    q: WorkQueue,
    batch_id: str,
    tenant: str,
    n: int,
    rng: random.Random,
    priority: int = 1,
    order: float = 0.0,
) -> None:
    job = QueuedBatch(
        batch_id,
        f"files/data/{batch_id}",
        "/v1/completions",
        "m",
        "p",
        order,
        {"url": "unused"},
        tenant=tenant,
        priority=priority,
    )
    index = _index(n, rng)
    q.add_batch(job, index, make_ranges(job, index, np.ones(n, bool), 16))


class Sim:
    """Workers that pull from the queue when they have room for half an engine load, like EngineWorker."""

    def __init__(self, q: WorkQueue, workers: int, seed: int) -> None:
        self.q, self.rng = q, random.Random(seed)
        self.held = [deque() for _ in range(workers)]  # per worker: [tenant, tokens left, range state]
        self.tokens: dict[str, int] = {}  # generated tokens per tenant (after warm-up)
        self.first_taken: dict[str, int] = {}  # batch id -> the pull that first took its work
        self.pulls = 0
        self.step = 0

    def run(self, steps: int, warmup: int = 0) -> None:
        for _ in range(steps):
            for worker, held in enumerate(self.held):
                self._pull(worker, held)
                self._decode(held, counting=self.step >= warmup)
            self.step += 1

    def _pull(self, worker: int, held: deque) -> None:
        room = 2 * SLOTS - len(held)
        if room < SLOTS // 2:
            return
        self.pulls += 1
        for r in self.q.take(worker, room, "m@p", idle=False):
            state = {"range": r, "left": r.size, "used": 0}
            self.first_taken.setdefault(r.batch.batch_id, self.pulls)
            for _ in range(r.size):  # each request stops somewhere up to max_tokens
                held.append([r.batch.tenant, self.rng.randint(1, MAX_TOKENS), state])

    def _decode(self, held: deque, counting: bool) -> None:
        for request in list(held)[:SLOTS]:
            tenant, _, state = request
            request[1] -= 1
            state["used"] += 1
            if counting:
                self.tokens[tenant] = self.tokens.get(tenant, 0) + 1
            if request[1] == 0:
                held.remove(request)
                state["left"] -= 1
                if state["left"] == 0:
                    r = state["range"]
                    prompts = int(r.work) - r.size * MAX_TOKENS
                    self.q.settle(r, prompts + state["used"])

    def share(self, tenant: str) -> float:
        return self.tokens.get(tenant, 0) / sum(self.tokens.values())


def _two_tenants(weights: dict[str, float]) -> Sim:
    rng = random.Random(7)
    q = WorkQueue(lambda _ranks: 3, weights=lambda: weights)
    _add(q, "batch_a", "alpha", 20_000, rng)
    _add(q, "batch_b", "beta", 20_000, rng, order=-1.0)  # older: plain FIFO would give it everything
    sim = Sim(q, workers=3, seed=11)
    sim.run(1500, warmup=100)
    return sim


def test_equal_weights_share_generated_tokens_evenly():
    sim = _two_tenants({})
    assert abs(sim.share("alpha") - 0.5) <= 0.05, sim.tokens


def test_weights_three_to_one_share_three_to_one():
    sim = _two_tenants({"alpha": 3.0})
    assert abs(sim.share("alpha") - 0.75) <= 0.05, sim.tokens


def test_a_tenant_arriving_late_gets_its_share_at_once_and_no_credit_for_its_absence():
    rng = random.Random(3)
    q = WorkQueue(lambda _ranks: 2)
    _add(q, "batch_big", "alpha", 50_000, rng)
    sim = Sim(q, workers=2, seed=5)
    sim.run(1000)  # alpha alone for a long time
    arrival = sim.pulls
    _add(q, "batch_small", "beta", 20_000, rng)
    sim.tokens = {}
    sim.run(600)
    assert sim.first_taken["batch_small"] == arrival + 1  # its first range at the next pull
    assert abs(sim.share("beta") - 0.5) <= 0.05, sim.tokens  # no burst beyond its share either


def test_priorities_order_a_tenants_batches_and_other_tenants_keep_their_share():
    rng = random.Random(9)
    q = WorkQueue(lambda _ranks: 2)
    _add(q, "batch_low", "alpha", 300, rng, priority=2, order=1.0)
    _add(q, "batch_normal", "alpha", 300, rng, priority=1, order=2.0)
    _add(q, "batch_high", "alpha", 300, rng, priority=0, order=3.0)
    _add(q, "batch_other", "beta", 20_000, rng)
    sim = Sim(q, workers=2, seed=13)
    sim.run(3000)
    first = sim.first_taken
    assert first["batch_high"] < first["batch_normal"] < first["batch_low"]
    assert first["batch_other"] <= 2  # the other tenant is served next to alpha from the start
