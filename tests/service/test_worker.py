"""The engine worker as plain Python (the Ray actor wraps exactly this class)."""

from __future__ import annotations

import time

from bulkgen.runtime.worker import EngineWorker
from tests.service.conftest import MODEL, random_model


def _requests(prefix: str, n: int, max_tokens: int = 4) -> list[dict]:
    return [{"id": f"{prefix}:{i}", "prompt_token_ids": [5 + i, 6, 7],
             "params": {"max_tokens": max_tokens, "temperature": 0.0}} for i in range(n)]


def _collect(worker: EngineWorker, group: str, n: int, timeout: float = 60) -> list[dict]:
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += worker.poll(group, 0.2)["finished"]
    return got


def _worker() -> EngineWorker:
    worker = EngineWorker(0, {"max_num_seqs": 8})
    worker.load(MODEL, str(random_model()))
    return worker


def test_groups_never_receive_each_others_results():
    worker = _worker()
    worker.submit("batch-a", _requests("a", 5))
    worker.submit("batch-b", _requests("b", 3))
    b = _collect(worker, "batch-b", 3)
    a = _collect(worker, "batch-a", 5)
    assert sorted(r["request_id"] for r in a) == [f"a:{i}" for i in range(5)]
    assert sorted(r["request_id"] for r in b) == [f"b:{i}" for i in range(3)]
    assert all(r["completion_tokens"] == 4 and r["completions"][0]["finish_reason"] == "length" for r in a + b)


def test_engine_failure_fails_held_requests_and_the_worker_recovers():
    worker = _worker()
    broken = worker.engine

    def explode():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    broken.step = explode
    worker.submit("g", _requests("x", 2, max_tokens=50))
    failed = _collect(worker, "g", 2)
    assert {r["request_id"] for r in failed} == {"x:0", "x:1"}
    assert all(r["code"] == "engine_error" and "illegal memory access" in r["error"] for r in failed)
    assert worker.engine is not broken  # rebuilt from the same model
    worker.submit("g", _requests("y", 2))
    assert len(_collect(worker, "g", 2)) == 2


def test_release_drops_a_finished_groups_leftovers():
    worker = _worker()
    worker.submit("gone", _requests("z", 3, max_tokens=200))
    worker.release("gone")
    time.sleep(0.5)
    assert worker.poll("gone", 0.1)["finished"] == []
    assert not worker.engine.has_unfinished()
