"""A tensor-parallel worker on a real local Ray: one worker of two gloo ranks (the actor is rank 0, rank 1
its process) runs a batch; rank 1 is killed mid-batch, the step fails on rank 0 within the collective
timeout, the whole group counts as one lost worker, a new group is placed, and every custom_id comes
back exactly once."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

from bulkgen.models.registry import EVERY_MODEL
from bulkgen.settings import Settings, WorkerSettings
from tests.runtime.test_faults import _assert_exactly_once, _create, _held_rows, _rows
from tests.support.service import MODEL, Service, random_model, wait_for
from tests.support.wait import wait_until


def _ranks(service) -> list[dict] | None:
    url = f"{service.base_url}/dashboard/workers"
    workers = json.loads(urllib.request.urlopen(url, timeout=30).read())["data"]
    return next(w for w in workers if w["index"] == 0)["ranks"]


def test_a_killed_rank_takes_its_group_down_and_the_batch_completes_exactly_once(tmp_path, engine_gate):
    engine = {
        "max_num_seqs": 32,
        "max_num_batched_tokens": 512,
        "collective_timeout_s": 30,
    }
    workers = WorkerSettings(cpu_workers=1, engine_kwargs=engine, tensor_parallel={EVERY_MODEL: 2})
    service = Service(
        Settings(
            storage=str(tmp_path / "store"),
            models={MODEL: str(random_model())},
            range_size=16,
            workers=workers,
        )
    )
    try:
        client = service.client()
        rows = _held_rows("h", 16, max_tokens=32) + _rows("k", 48, 8)
        batch = _create(client, tmp_path / "tp.jsonl", rows)
        wait_for(client, batch.id, lambda b: b.request_counts.completed >= 16, timeout=300)
        engine_gate.wait_held()
        ranks = wait_until(lambda: _ranks(service), 60, "the worker's ranks on the dashboard")
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["device"] == "cpu" for r in ranks)
        assert all(r["weight_bytes"] > 0 for r in ranks)
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        engine_gate.open()  # the next step needs rank 1: it fails, and the group with it
        batch = wait_for(client, batch.id, lambda b: b.status in {"completed", "failed"}, timeout=400)
        assert batch.status == "completed" and batch.request_counts.failed == 0
        _assert_exactly_once(client, batch, rows)
        replaced = wait_until(lambda: _ranks(service), 120, "the new group's ranks")
        assert {r["pid"] for r in replaced}.isdisjoint(r["pid"] for r in ranks)
    finally:
        service.stop()
